"""A server kind's topology: its file (or this machine's), with the fleet file's overrides of
device cores and link speeds applied, and its NIC as a link into the ingress device."""

from __future__ import annotations

from dataclasses import replace

from nicoffload.fleet.spec import LOCAL, FleetError, ServerKind
from nicoffload.topology import Device, Link, Topology, load_topology, local_topology

NIC = "nic"  # the station of a server's network port: requests arrive through it


def server_topology(kind: ServerKind) -> Topology:
    """The kind's topology with its overrides; an override naming no device or link of it is
    a FleetError at the override."""
    topo = local_topology() if kind.topology == LOCAL else load_topology(kind.topology)
    cores = dict(kind.cores)
    unknown = sorted(set(cores) - set(topo.ids))
    if unknown:
        raise FleetError(
            f"server kind '{kind.name}': cores of '{unknown[0]}', but topology '{topo.name}' "
            f"has devices {', '.join(topo.ids)}",
            kind.mark,
        )
    devices = tuple(_cores(d, cores[d.id]) if d.id in cores else d for d in topo.devices)
    links = list(topo.links)
    for o in kind.links:
        at = next((i for i, k in enumerate(links) if {k.a, k.b} == set(o.between)), None)
        if at is None:
            have = ", ".join(f"{k.a}-{k.b}" for k in links) or "none"
            raise FleetError(
                f"server kind '{kind.name}': no link between {o.between[0]} and "
                f"{o.between[1]} in topology '{topo.name}' (links: {have})",
                o.mark,
            )
        links[at] = _speed(links[at], o.bandwidth, o.latency_ms)
    return replace(topo, devices=devices, links=tuple(links))


def _cores(d: Device, n: int) -> Device:
    """A device with `n` cores; a CPU or DPU's parallel capacity follows them."""
    return replace(d, cores=n, capacity=float(n) if d.kind != "gpu" else d.capacity)


def _speed(link: Link, bandwidth: float | None, latency_ms: float | None) -> Link:
    """The link at the fleet's speed, both directions (`Link.reverse`) alike."""
    return replace(
        link,
        bandwidth=link.bandwidth if bandwidth is None else bandwidth,
        latency_ms=link.latency_ms if latency_ms is None else latency_ms,
        reverse=None if link.reverse is None else _speed(link.reverse, bandwidth, latency_ms),
    )
