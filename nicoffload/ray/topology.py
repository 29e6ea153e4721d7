"""A server's Topology from a Ray cluster's nodes and their labels, and links from a declared
network file. Pure: it reads node records (as `ray.nodes()` gives them), not the cluster, so
it imports no ray and is tested without one.

Labels (on `ray start --labels` or a node's config):

    nicoffload.io/role:    host | dpu | gpu | cpu-pool
    nicoffload.io/server:  the server a host, dpu or gpu node belongs to (a pool belongs to none)
    nicoffload.io/dpu-gen: bf2 | bf3 (a dpu node's profile: bluefield2-arm, bluefield3-arm)
    nicoffload.io/agent-port: PORT (an agent already runs on that node, under systemd: the
                          host attaches to it at the node's address instead of starting one)

A server's host node is the `cpu` device (the process running the Session is there), its GPUs
(Ray's GPU resource on that node) are gpu0..; every dpu node of the server and every cpu-pool
node is an agent device (kind `dpu`: reached through a DPU agent started on it), each linked to
the host: the server's DPUs `dpu0`.. in node-id order, a pool node `dpu-pool-` and the first
8 hex digits of its node id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, TopologyError
from nicoffload.topology import (
    TRANSPORTS,
    Device,
    Link,
    Topology,
    parse_rate,
    parse_time_ms,
)
from nicoffload.yamlmarks import MMap, MSeq, did_you_mean, read_marked

ROLE = "nicoffload.io/role"
SERVER = "nicoffload.io/server"
DPU_GEN = "nicoffload.io/dpu-gen"
AGENT_PORT = "nicoffload.io/agent-port"  # an agent runs there already (systemd): attach to it
NODE_ID = "ray.io/node-id"  # Ray's own label: selects one node exactly
POOL_ID = 8  # hex digits of the node id in a pool device's id
ROLES = ("host", "dpu", "gpu", "cpu-pool")
GENS = {"bf2": "bluefield2-arm", "bf3": "bluefield3-arm"}
# links to the host when the network file names none: the transport's own costs, and these rates
DEFAULT_LINKS: dict[str, dict[str, Any]] = {
    "dpu": {"transport": "tcp", "bandwidth": 200e9 / 8},  # a BlueField-3's 200 Gb/s port
    "cpu-pool": {"transport": "tcp", "bandwidth": 25e9 / 8},  # a 25 Gb/s server NIC
}
AGENT_TRANSPORTS = ("tcp", "shm", "rdma")  # what an agent's outputs reach the host over
NETWORK_KEYS = ("links", "profiles")
LINK_KEYS = ("between", "transport", "bandwidth", "latency", "cpu_ns_per_byte", "cpu_us_per_batch")


@dataclass(frozen=True)
class Node:
    """One live Ray node: its id, labels and CPU and GPU resources."""

    id: str
    labels: dict[str, str]
    cpus: int
    gpus: int
    ip: str = ""

    @property
    def attached(self) -> str | None:
        """HOST:PORT of an agent already running there (systemd), to attach to, else None."""
        port = self.labels.get(AGENT_PORT)
        return f"{self.ip}:{port}" if port and self.ip else None

    @property
    def role(self) -> str | None:
        return self.labels.get(ROLE)

    @property
    def server(self) -> str | None:
        return self.labels.get(SERVER)


@dataclass(frozen=True)
class Network:
    """A declared network: per role (`dpu`, `cpu-pool`) its link to the host, and profiles
    per role (a shipped profile name or a path)."""

    links: dict[str, Link] = field(default_factory=dict)  # by role; a/b filled per device
    profiles: dict[str, str] = field(default_factory=dict)
    source: str = "defaults"


@dataclass(frozen=True)
class ClusterTopology:
    """The Topology of one server, the Ray node behind each agent device, and what was left
    out of it (and why)."""

    topology: Topology
    agent_nodes: dict[str, Node]  # agent device id -> its Ray node
    server: str
    notes: tuple[str, ...] = ()


def nodes_of(raw: list[dict[str, Any]]) -> list[Node]:
    """The live nodes of `ray.nodes()`, by node id."""
    out = []
    for n in raw:
        if not n.get("Alive", False):
            continue
        res = n.get("Resources", {})
        labels = {str(k): str(v) for k, v in (n.get("Labels") or {}).items()}
        cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
        out.append(Node(n["NodeID"], labels, cpus, gpus, str(n.get("NodeManagerAddress", ""))))
    return sorted(out, key=lambda n: n.id)


def _profile(role: str, node: Node, network: Network) -> str:
    from nicoffload.profiles import default_profile_for, profile_path

    name = network.profiles.get(role)
    if name is None and role == "dpu" and node.labels.get(DPU_GEN) in GENS:
        name = GENS[node.labels[DPU_GEN]]
    if name is None:
        return default_profile_for({"dpu": "dpu", "gpu": "gpu"}.get(role, "cpu"))
    return str(profile_path(name))


def cluster_topology(
    nodes: list[Node], network: Network | None = None, server: str | None = None
) -> ClusterTopology:
    """Server `server`'s topology (the only server when None): its host, its GPUs, its DPUs
    and every cpu-pool node. A node without a role label is not nicoffload's and is left out."""
    network = network or Network()
    servers = sorted({n.server for n in nodes if n.role == "host" and n.server})
    if server is None:
        if len(servers) != 1:
            raise TopologyError(
                f"the Ray cluster has {len(servers)} servers with a host node "
                f"({', '.join(servers) or f'none labelled {ROLE}=host, {SERVER}=ID'}): "
                "name one (--ray-server)"
            )
        server = servers[0]
    hosts = [n for n in nodes if n.role == "host" and n.server == server]
    if not hosts:
        raise TopologyError(
            f"server '{server}' has no live host node"
            + (did_you_mean(server, servers) if servers else " (the cluster has none)")
        )
    if len(hosts) > 1:
        raise TopologyError(f"server '{server}' has {len(hosts)} host nodes; it must have one")
    host = hosts[0]
    devices = [Device("cpu", "cpu", max(1, host.cpus), float(max(1, host.cpus)), None, None,
                      _profile("host", host, network))]  # fmt: skip
    links: list[Link] = []
    agent_nodes: dict[str, Node] = {}
    notes = []
    for i in range(host.gpus):
        gid = f"gpu{i}"
        devices.append(Device(gid, "gpu", 1, 1.0, None, None, _profile("gpu", host, network)))
        links.append(Link("cpu", gid, "pcie", 25e9, TRANSPORTS["pcie"]["latency_ms"], 0.0))
    count = {"dpu": 0}
    for node in nodes:
        role = node.role
        if role is None or node is host:
            continue
        if role not in ROLES:
            notes.append(f"node {node.id[:8]}: unknown {ROLE} '{role}' (one of {', '.join(ROLES)})")
            continue
        if role == "gpu" or (role in ("host", "dpu") and node.server != server):
            if role == "gpu" and node.server == server:
                notes.append(
                    f"node {node.id[:8]}: a gpu node apart from the host is not used yet "
                    "(GPU stages run in the host's process: give the host node its GPUs)"
                )
            continue
        # a pool node's id is its node's, so that nodes joining or leaving rename no other
        dev_id = f"dpu{count['dpu']}" if role == "dpu" else f"dpu-pool-{node.id[:POOL_ID]}"
        count["dpu"] += role == "dpu"
        cores = max(1, node.cpus)
        devices.append(
            Device(
                dev_id,
                "dpu",
                cores,
                float(cores),
                None,
                node.attached,
                _profile(role, node, network),
            )
        )
        links.append(_link_for(role, dev_id, network))
        agent_nodes[dev_id] = node
    topo = Topology(
        f"ray-{server}",
        tuple(devices),
        tuple(links),
        ingress="cpu",  # the host's process reads the items (as `run` and a Session do)
        egress="gpu0" if host.gpus else "cpu",
        source=f"ray cluster (network: {network.source})",
    )
    return ClusterTopology(topo, agent_nodes, server, tuple(notes))


def _link_for(role: str, dev_id: str, network: Network) -> Link:
    import dataclasses

    declared = network.links.get(role)
    if declared is not None:
        return dataclasses.replace(declared, a=dev_id, b="cpu")
    d = DEFAULT_LINKS[role]
    t = TRANSPORTS[d["transport"]]
    return Link(
        dev_id,
        "cpu",
        d["transport"],
        float(d["bandwidth"]),
        t["latency_ms"],
        t["cpu_ns_per_byte"],
        cpu_us_per_batch=t["cpu_us_per_batch"],
    )


def load_network(path: str | Path) -> Network:
    """Read a network file: `links` (each `between: [ROLE, host]`, a transport, bandwidth and
    optionally latency and CPU costs) and `profiles` ({ROLE: profile}). Mistakes are
    TopologyErrors at their line."""
    from nicoffload.profiles import profile_path

    doc = read_marked(path, TopologyError)
    if not isinstance(doc, MMap):
        raise TopologyError(
            "a network file must be a mapping (links, profiles)", Mark(str(path), 1, 1)
        )
    _keys(doc, NETWORK_KEYS, "network")
    links: dict[str, Link] = {}
    raw = doc.get("links", MSeq())
    if not isinstance(raw, MSeq):
        raise TopologyError("'links' must be a list of links", doc.mark_of("links"))
    for item, mark in zip(raw, getattr(raw, "item_marks", []), strict=True):
        role, link = _declared(item, mark)
        if role in links:
            raise TopologyError(f"link: a second link between '{role}' and 'host'", mark)
        links[role] = link
    profiles: dict[str, str] = {}
    raw_p = doc.get("profiles")
    if raw_p is not None and not isinstance(raw_p, MMap):
        raise TopologyError("'profiles' must map a role to a profile", doc.mark_of("profiles"))
    for role, name in (raw_p or {}).items():
        if role not in ROLES:
            raise TopologyError(
                f"profiles: unknown role '{role}'{did_you_mean(str(role), ROLES)}",
                raw_p.key_marks[role],
            )
        try:
            profiles[str(role)] = str(profile_path(str(name), Path(path).parent))
        except LookupError as exc:
            raise TopologyError(f"profiles: {exc}", raw_p.value_marks[role]) from None
    return Network(links, profiles, str(path))


def _keys(m: MMap, allowed: tuple[str, ...], where: str) -> None:
    for key in m:
        if key not in allowed:
            raise TopologyError(
                f"{where}: unknown key '{key}'{did_you_mean(str(key), allowed)}", m.key_marks[key]
            )


def _declared(raw: Any, mark: Mark) -> tuple[str, Link]:
    if not isinstance(raw, MMap):
        raise TopologyError("a link must be a mapping (between, transport, bandwidth)", mark)
    _keys(raw, LINK_KEYS, "link")
    for key in ("between", "transport", "bandwidth"):
        if key not in raw:
            raise TopologyError(f"link: missing '{key}'", raw.mark)
    between = raw["between"]
    ends = sorted(map(str, between)) if isinstance(between, MSeq) else []
    agent_roles = ("dpu", "cpu-pool")
    if len(ends) != 2 or "host" not in ends or not any(e in agent_roles for e in ends):
        raise TopologyError(
            f"link: 'between' must be [dpu, host] or [cpu-pool, host], got {between!r}",
            raw.mark_of("between"),
        )
    role = ends[0] if ends[1] == "host" else ends[1]
    transport = raw["transport"]
    if transport not in AGENT_TRANSPORTS:
        raise TopologyError(
            f"link: transport {transport!r} cannot carry an agent's outputs "
            f"(one of {', '.join(AGENT_TRANSPORTS)})",
            raw.mark_of("transport"),
        )
    bandwidth = parse_rate(raw["bandwidth"])
    if bandwidth is None:
        raise TopologyError(
            f"link: 'bandwidth' must be a rate like 100Gb/s, got {raw['bandwidth']!r}",
            raw.mark_of("bandwidth"),
        )
    d = TRANSPORTS[transport]
    latency = parse_time_ms(raw.get("latency", d["latency_ms"]))
    if latency is None:
        raise TopologyError(
            f"link: 'latency' must be a time like 10us, got {raw['latency']!r}",
            raw.mark_of("latency"),
        )
    costs = []
    for key in ("cpu_ns_per_byte", "cpu_us_per_batch"):
        v = raw.get(key, d[key])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise TopologyError(f"link: '{key}' must be a number >= 0, got {v!r}", raw.mark_of(key))
        costs.append(float(v))
    link = Link(role, "host", transport, bandwidth, latency, costs[0], mark, costs[1])
    return role, link
