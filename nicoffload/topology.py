"""Topology: the devices a pipeline can be placed on, the links between them, and the ingress.

Read from a YAML file (every mistake is a TopologyError at `file:line:col`), or autodetected for
the local machine: the host CPU, an emulated DPU (a local agent on loopback), and the GPU if CUDA
works. Routes between devices are fixed here, once, so the planner and the runtime agree on them.
"""

from __future__ import annotations

import functools
import heapq
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, TopologyError
from nicoffload.procstat import cores
from nicoffload.yamlmarks import MMap, MSeq, did_you_mean, read_marked

KINDS = ("cpu", "dpu", "gpu")
# `p4`: the NIC ports each device is reached on, read by nicoffload.p4.ports (not the planner).
TOP_KEYS = ("name", "description", "devices", "links", "ingress", "egress", "p4")
DEVICE_KEYS = ("kind", "cores", "capacity", "memory", "address", "profile", "emulated")
LINK_KEYS = ("between", "transport", "bandwidth", "latency", "cpu_ns_per_byte", "cpu_us_per_batch")
# CPU time at each CPU endpoint (cpu or dpu) of a hop, per byte and per batch, as nicoffload's
# own transports cost it (`nicoffload profile` measures tcp and shm on a machine; these are the
# 2-core development VM's figures, 2026-12-02, GMAC frames): TCP copies and MACs every byte on
# both sides;
# shared memory is one memcpy by the sender and a MAC on the control frames only; RDMA and DMA
# move bytes without the CPU (their per-batch cost, posting and completing, is not measured yet).
TRANSPORTS: dict[str, dict[str, float]] = {
    "shm": {"latency_ms": 0.04, "cpu_ns_per_byte": 0.06, "cpu_us_per_batch": 40.0},
    "tcp": {"latency_ms": 0.08, "cpu_ns_per_byte": 0.3, "cpu_us_per_batch": 60.0},
    "rdma": {"latency_ms": 0.005, "cpu_ns_per_byte": 0.0, "cpu_us_per_batch": 0.0},
    "rdma-gpudirect": {"latency_ms": 0.005, "cpu_ns_per_byte": 0.0, "cpu_us_per_batch": 0.0},
    "pcie": {"latency_ms": 0.01, "cpu_ns_per_byte": 0.0, "cpu_us_per_batch": 0.0},
}
_ID = re.compile(r"^(cpu|dpu|gpu)[A-Za-z0-9_]*$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([GMK]?)(b|B|bit|bits)/s\s*$")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(ns|us|µs|ms|s)\s*$")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)\s*$")


@dataclass(frozen=True)
class Device:
    """One place a node can run. `capacity` is how many items it works on in parallel."""

    id: str
    kind: str
    cores: int
    capacity: float
    memory: int | None = None  # bytes; None: not limited
    address: str | None = None
    profile: str | None = None  # a shipped profile name or a path
    emulated: bool = False
    mark: Mark | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Link:
    """A full-duplex link between two devices; each direction carries `bandwidth` bytes/s.

    `reverse`, where the two directions move bytes differently, is the b -> a direction's
    own (a Link from b to a): a local agent's outputs come to the host over shared memory while
    what the host sends it goes over the agent's tcp connection (`local_topology`)."""

    a: str
    b: str
    transport: str
    bandwidth: float  # bytes per second, each direction
    latency_ms: float
    cpu_ns_per_byte: float
    mark: Mark | None = field(default=None, compare=False)
    cpu_us_per_batch: float = 0.0  # CPU at each CPU end per batch, whatever its size
    reverse: Link | None = field(default=None, compare=False)

    def other(self, end: str) -> str:
        return self.b if end == self.a else self.a

    def toward(self, dst: str) -> Link:
        """The link as bytes going to `dst` cross it."""
        return self.reverse if self.reverse is not None and dst == self.a else self


@dataclass(frozen=True)
class Hop:
    """One directed hop of a route; `link` as bytes going src -> dst cross it (`Link.toward`)."""

    src: str
    dst: str
    link: Link

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class Topology:
    name: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    ingress: str
    egress: str
    source: str = "local"

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    def device(self, id: str) -> Device:
        return next(d for d in self.devices if d.id == id)

    def route(self, src: str, dst: str) -> tuple[Hop, ...]:
        """The hops from src to dst: fastest for a 1 MB message, then fewest hops, then by name."""
        if src == dst:
            return ()
        known = self._routes.get((src, dst))
        if known is None:
            known = self._routes[(src, dst)] = self._route(src, dst)
        return known

    @functools.cached_property
    def _routes(self) -> dict[tuple[str, str], tuple[Hop, ...]]:
        return {}

    def _route(self, src: str, dst: str) -> tuple[Hop, ...]:
        best: dict[str, tuple[float, int]] = {src: (0.0, 0)}
        prev: dict[str, Hop] = {}
        heap: list[tuple[float, int, str]] = [(0.0, 0, src)]
        while heap:
            cost, hops, here = heapq.heappop(heap)
            if here == dst:
                break
            if (cost, hops) > best[here]:
                continue
            for link in sorted(self.links, key=lambda k: (k.a, k.b)):
                if here not in (link.a, link.b):
                    continue
                there = link.other(here)
                way = link.toward(there)
                step = (cost + way.latency_ms + 1e9 / way.bandwidth, hops + 1)
                if step < best.get(there, (float("inf"), 0)):
                    best[there] = step
                    prev[there] = Hop(here, there, way)
                    heapq.heappush(heap, (*step, there))
        if dst not in prev:
            raise TopologyError(f"topology '{self.name}': no route from '{src}' to '{dst}'")
        path = [prev[dst]]
        while path[-1].src != src:
            path.append(prev[path[-1].src])
        return tuple(reversed(path))


def parse_rate(value: Any) -> float | None:
    """'400Gb/s', '50 GB/s', '800MB/s' -> bytes per second; a bare number is Gb/s."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) * 1e9 / 8 if value > 0 else None
    m = _RATE.match(str(value))
    if not m:
        return None
    scale = {"G": 1e9, "M": 1e6, "K": 1e3, "": 1.0}[m.group(2)]
    bits = m.group(3) != "B"
    return float(m.group(1)) * scale / (8 if bits else 1) or None


def parse_time_ms(value: Any) -> float | None:
    """'5us', '0.03 ms', '2ns' -> milliseconds; a bare number is milliseconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if value >= 0 else None
    m = _TIME.match(str(value))
    if not m:
        return None
    unit = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
    return float(m.group(1)) * unit


def parse_size(value: Any) -> int | None:
    """'64GiB', '512 MB' -> bytes; a bare integer is bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    m = _SIZE.match(str(value))
    if not m:
        return None
    unit = m.group(2)
    power = "BKMGT".index(unit[0])
    base = 1024 if "i" in unit else 1000
    return int(float(m.group(1)) * base**power) or None


def _bad(what: str, value: Any, want: str, mark: Mark) -> TopologyError:
    return TopologyError(f"{what} must be {want}, got {value!r}", mark)


def _keys(m: MMap, allowed: tuple[str, ...], where: str) -> None:
    for key in m:
        if key not in allowed:
            raise TopologyError(
                f"{where}: unknown key '{key}'{did_you_mean(str(key), allowed)}", m.key_marks[key]
            )


def _device(dev_id: Any, body: Any, doc: MMap, marks: tuple[Mark, Mark]) -> Device:
    key_mark, value_mark = marks
    if not isinstance(dev_id, str) or not _ID.match(dev_id):
        raise TopologyError(
            f"device id {dev_id!r} must start with its kind (cpu, dpu or gpu), like 'dpu0'",
            key_mark,
        )
    where = f"device '{dev_id}'"
    if not isinstance(body, MMap):
        raise _bad(where, body, "a mapping (kind, cores, memory, profile, ...)", value_mark)
    _keys(body, DEVICE_KEYS, where)
    kind = body.get("kind", dev_id[:3])
    if kind not in KINDS:
        raise TopologyError(
            f"{where}: unknown kind {kind!r}{did_you_mean(str(kind), KINDS)}", body.mark_of("kind")
        )
    if not dev_id.startswith(kind):
        raise TopologyError(
            f"{where}: the id must start with its kind '{kind}'", body.mark_of("kind")
        )
    cores = body.get("cores", 1)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise _bad(f"{where}: 'cores'", cores, "a positive integer", body.mark_of("cores"))
    capacity = body.get("capacity", float(cores) if kind != "gpu" else 1.0)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or capacity <= 0:
        raise _bad(f"{where}: 'capacity'", capacity, "a positive number", body.mark_of("capacity"))
    memory = None
    if "memory" in body:
        memory = parse_size(body["memory"])
        if memory is None:
            raise _bad(
                f"{where}: 'memory'", body["memory"], "a size like 32GiB", body.mark_of("memory")
            )
    profile = body.get("profile")
    if profile is not None:
        from nicoffload.profiles import profile_path

        base = Path(doc.mark.file).parent
        try:
            profile = str(profile_path(str(profile), base))
        except LookupError as exc:
            raise TopologyError(f"{where}: {exc}", body.mark_of("profile")) from None
    return Device(
        dev_id,
        kind,
        cores,
        float(capacity),
        memory,
        None if body.get("address") is None else str(body["address"]),
        profile,
        bool(body.get("emulated", False)),
        key_mark,
    )


def _link(raw: Any, mark: Mark, ids: list[str]) -> Link:
    if not isinstance(raw, MMap):
        raise _bad("a link", raw, "a mapping (between, transport, bandwidth, latency)", mark)
    _keys(raw, LINK_KEYS, "link")
    for key in ("between", "transport", "bandwidth"):
        if key not in raw:
            raise TopologyError(f"link: missing '{key}'", raw.mark)
    between = raw["between"]
    bmark = raw.mark_of("between")
    if not isinstance(between, MSeq) or len(between) != 2 or between[0] == between[1]:
        raise _bad("link: 'between'", between, "two different device ids", bmark)
    for end, emark in zip(between, between.item_marks, strict=True):
        if end not in ids:
            raise TopologyError(f"link: unknown device {end!r}{did_you_mean(str(end), ids)}", emark)
    transport = raw["transport"]
    if transport not in TRANSPORTS:
        raise TopologyError(
            f"link: unknown transport {transport!r}{did_you_mean(str(transport), list(TRANSPORTS))}",
            raw.mark_of("transport"),
        )
    if transport == "rdma-gpudirect" and not any(str(e).startswith("gpu") for e in between):
        raise TopologyError("link: rdma-gpudirect needs a GPU at one end", raw.mark_of("transport"))
    bandwidth = parse_rate(raw["bandwidth"])
    if bandwidth is None:
        raise _bad(
            "link: 'bandwidth'",
            raw["bandwidth"],
            "a rate like 400Gb/s or 50GB/s",
            raw.mark_of("bandwidth"),
        )
    defaults = TRANSPORTS[transport]
    latency = parse_time_ms(raw.get("latency", defaults["latency_ms"]))
    if latency is None:
        raise _bad(
            "link: 'latency'", raw["latency"], "a time like 5us or 0.03ms", raw.mark_of("latency")
        )
    cpu, per_batch = (
        raw.get(key, defaults[key]) for key in ("cpu_ns_per_byte", "cpu_us_per_batch")
    )
    for key, value in (("cpu_ns_per_byte", cpu), ("cpu_us_per_batch", per_batch)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise _bad(f"link: '{key}'", value, "a finite number >= 0", raw.mark_of(key))
    return Link(
        str(between[0]),
        str(between[1]),
        transport,
        bandwidth,
        latency,
        float(cpu),
        mark,
        float(per_batch),
    )


def _end(doc: MMap, key: str, ids: list[str], default: str) -> str:
    value = doc.get(key, default)
    if value not in ids:
        raise TopologyError(
            f"'{key}': unknown device {value!r}{did_you_mean(str(value), ids)}", doc.mark_of(key)
        )
    return str(value)


def load_topology(path: str | Path) -> Topology:
    """Read and check a topology file; the first mistake raises TopologyError at its mark."""
    doc = read_marked(path, TopologyError)
    if not isinstance(doc, MMap):
        raise TopologyError(
            "a topology file must be a mapping (devices, links, ingress)", Mark(str(path), 1, 1)
        )
    _keys(doc, TOP_KEYS, "topology")
    if "devices" not in doc:
        raise TopologyError("topology: missing 'devices'", doc.mark)
    raw = doc["devices"]
    if not isinstance(raw, MMap) or not raw:
        raise _bad("'devices'", raw, "a mapping of device id to device", doc.mark_of("devices"))
    devices = [_device(k, v, doc, (raw.key_marks[k], raw.value_marks[k])) for k, v in raw.items()]
    ids = [d.id for d in devices]
    links_raw = doc.get("links", MSeq())
    if "links" in doc and not isinstance(links_raw, MSeq):
        raise _bad("'links'", links_raw, "a list of links", doc.mark_of("links"))
    marks = getattr(links_raw, "item_marks", [])
    links = [_link(r, m, ids) for r, m in zip(links_raw, marks, strict=True)]
    seen: dict[frozenset[str], Link] = {}
    for link in links:
        pair = frozenset((link.a, link.b))
        if pair in seen:
            first = seen[pair].mark
            raise TopologyError(
                f"link: a second link between '{link.a}' and '{link.b}' (first at line {first.line if first else '?'})",
                link.mark,
            )
        seen[pair] = link
    kinds = [d.kind for d in devices]
    default_in = ids[kinds.index("dpu")] if "dpu" in kinds else ids[0]
    ingress = _end(doc, "ingress", ids, default_in)
    egress = _end(doc, "egress", ids, ids[kinds.index("gpu")] if "gpu" in kinds else ingress)
    name = str(doc.get("name", Path(path).stem))
    topo = Topology(name, tuple(devices), tuple(links), ingress, egress, str(path))
    for dev in devices:
        if dev.id != ingress:
            try:
                topo.route(ingress, dev.id)
            except TopologyError:
                raise TopologyError(
                    f"device '{dev.id}' has no link path to the ingress '{ingress}'", dev.mark
                ) from None
    return topo


def _cuda_gpu_name() -> str | None:
    """The name of CUDA device 0 when a GPU library is installed and CUDA works, else None;
    never raises."""
    from importlib.util import find_spec

    def by_cupy() -> str | None:
        import cupy.cuda

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        name = cupy.cuda.runtime.getDeviceProperties(0).get("name", b"")
        return name.decode() if isinstance(name, bytes) else str(name)

    def by_torch() -> str | None:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None

    for module, probe in (("torch", by_torch), ("cupy", by_cupy)):
        if find_spec(module) is None:
            continue
        try:
            return probe()
        except Exception:
            continue
    return None


def _cuda_works() -> bool:
    """True only when a GPU library is installed and says CUDA works; never raises."""
    return _cuda_gpu_name() is not None


def _gpu_profile(name: str) -> str:
    """This machine's measured GPU profile, else the shipped one for its model: the measured
    H200's, or the H100 estimate for any other GPU."""
    from nicoffload.profiles import SHIPPED_DIR, default_profile_for, measured_path

    if not measured_path("gpu").is_file() and "H200" in name.upper():
        return str(SHIPPED_DIR / "h200.json")
    return default_profile_for("gpu")


def _host_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _measured_link(a: str, b: str, transport: str, profile: str, bandwidth: float) -> Link:
    """A local link as `nicoffload profile` measured it, else the transport's defaults."""
    from nicoffload.errors import ProfileError
    from nicoffload.profiles import load_profile

    try:
        measured = load_profile(profile).links.get(transport)
    except ProfileError:
        measured = None
    d = TRANSPORTS[transport]
    bw, latency = (
        (bandwidth, d["latency_ms"])
        if measured is None
        else (
            measured.bandwidth,
            measured.latency_ms,
        )
    )
    # a link measured with raw sockets (no per-batch figure): its CPU costs leave ours out
    trusted = measured is not None and measured.cpu_us_per_batch is not None
    per_byte = measured.cpu_ns_per_byte if trusted else d["cpu_ns_per_byte"]
    per_batch = measured.cpu_us_per_batch if trusted else d["cpu_us_per_batch"]
    return Link(a, b, transport, bw, latency, per_byte, cpu_us_per_batch=per_batch)


DPU_LINKS = ("shm", "tcp")  # what a local emulated DPU sends the host over


def local_topology(
    *,
    emulate_dpu: bool = True,
    gpu: bool | None = None,
    dpu_share: float = 0.5,
    ingress: str = "cpu",
    dpu_link: str | None = None,
) -> Topology:
    """The machine this runs on: host cpu, an emulated dpu0 on loopback, gpu0 if CUDA works
    (`gpu` True or False forces it in or out; its profile follows its name, `_gpu_profile`).

    `ingress` is where the items are: on the host for `run` and a Session (this process reads
    them and sends what the DPU stage needs to the agent), so a plan pays for moving them to
    the DPU; `"dpu0"` when the agent itself receives the requests (serving).

    The emulated DPU is the agent daemon pinned to a share of the host's cores; those cores are
    taken from the host's count so that the planner does not count them twice. What it sends
    the host goes over `dpu_link` (default: `$NICOFFLOAD_DPU_LINK`, else `shm`): shared
    memory, as a BlueField's agent writes the host's memory (RDMA: no host CPU per byte), or
    `tcp`, as an agent across a network; what the host sends it goes over the agent's tcp
    connection either way (the link's `reverse`). Each device's
    profile is this machine's measured one when `nicoffload profile` has written it, else the
    shipped estimate for its kind.
    """
    from nicoffload.profiles import default_profile_for

    dpu_link = dpu_link or os.environ.get("NICOFFLOAD_DPU_LINK") or "shm"
    if emulate_dpu and dpu_link not in DPU_LINKS:
        raise TopologyError(
            f"the local DPU's link {dpu_link!r} (NICOFFLOAD_DPU_LINK?): expected one of "
            f"{', '.join(DPU_LINKS)}"
        )
    n = cores()
    dpu_cores = max(1, int(n * dpu_share)) if emulate_dpu and n > 1 else 0
    host_cores = n - dpu_cores
    mem = _host_memory()
    cpu_profile = default_profile_for("cpu")
    devices = [Device("cpu", "cpu", host_cores, float(host_cores), mem, None, cpu_profile)]
    links = []
    if dpu_cores:
        devices.append(
            Device(
                "dpu0", "dpu", dpu_cores, float(dpu_cores), mem, "127.0.0.1:7700", cpu_profile, True
            )
        )
        # what the agent sends the host goes over `dpu_link`; what the host sends the agent
        # (items, and a batch for a DPU stage after a host one) over the agent's connection
        out = _measured_link("dpu0", "cpu", dpu_link, cpu_profile, bandwidth=2.5e9)
        if dpu_link != "tcp":
            back = _measured_link("cpu", "dpu0", "tcp", cpu_profile, bandwidth=2.5e9)
            out = replace(out, reverse=back)
        links.append(out)
    gpu_name = _cuda_gpu_name() if gpu is not False else None
    if gpu or gpu_name is not None:
        # capacity 1: GPU profiles cost a whole batch on the whole device, per item
        gpu_profile = _gpu_profile(gpu_name or "")
        devices.append(Device("gpu0", "gpu", 1, 1.0, None, None, gpu_profile))
        links.append(_measured_link("cpu", "gpu0", "pcie", gpu_profile, bandwidth=25e9))
    ids = [d.id for d in devices]
    return Topology(
        "local",
        tuple(devices),
        tuple(links),
        ingress=ingress if ingress in ids else "cpu",
        egress="gpu0" if "gpu0" in ids else "cpu",
        source="local",
    )
