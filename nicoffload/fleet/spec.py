"""A fleet description: server kinds (a topology each, with overrides), how many of each, the
request mix and the network, read from YAML. Every mistake is a FleetError at `file:line:col`.

    name: example
    servers:
      bf3: {count: 800, topology: ../pipelines/topologies/bluefield3-h100.yaml,
            cores: {cpu: 16}, profiles: [x86-server], nic: {bandwidth: 200Gb/s, latency: 5us},
            links: [{between: [dpu0, cpu], bandwidth: 100Gb/s}]}
    mix:
      - {pipeline: ../pipelines/resnet50.yaml, rate: 400000/s,
         sizes: {image: {height: 375, width: 500, bytes: 110000}}}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, UserError
from nicoffload.topology import parse_rate, parse_time_ms
from nicoffload.yamlmarks import MMap, MSeq, did_you_mean, read_marked

TOP_KEYS = ("name", "description", "servers", "mix", "duration", "seed")
SERVER_KEYS = ("count", "topology", "cores", "profiles", "nic", "links")
MIX_KEYS = ("pipeline", "rate", "sizes")
NIC_KEYS = ("bandwidth", "latency")
LINK_KEYS = ("between", "bandwidth", "latency")
SIZE_KEYS = ("height", "width", "bytes", "chars", "progressive")
LOCAL = "local"  # `topology: local`: this machine's (`topology.local_topology`)


class FleetError(UserError):
    """A mistake in a fleet file."""


@dataclass(frozen=True)
class Nic:
    """The link a server's requests arrive on, into its topology's ingress device."""

    bandwidth: float  # bytes per second
    latency_ms: float = 0.0


@dataclass(frozen=True)
class LinkOverride:
    """A topology link's bandwidth or latency, changed for this server kind."""

    between: tuple[str, str]
    bandwidth: float | None = None
    latency_ms: float | None = None
    mark: Mark | None = None


@dataclass(frozen=True)
class ServerKind:
    name: str
    count: int
    topology: str  # a topology file's path, or "local"
    cores: tuple[tuple[str, int], ...] = ()  # device id -> cores (and its capacity)
    profiles: tuple[str, ...] = ()  # profile names or paths, one per device kind
    nic: Nic | None = None
    links: tuple[LinkOverride, ...] = ()
    mark: Mark | None = None


@dataclass(frozen=True)
class Demand:
    """One pipeline of the mix: its fleet-wide request rate, spread evenly over the servers."""

    pipeline: str  # a pipeline file's path
    rate_per_s: float
    sizes: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()  # input -> typical size
    mark: Mark | None = None

    @property
    def typical(self) -> dict[str, dict[str, float]]:
        return {name: dict(t) for name, t in self.sizes}


@dataclass(frozen=True)
class Fleet:
    name: str
    servers: tuple[ServerKind, ...]
    mix: tuple[Demand, ...]
    duration_s: float = 10.0
    seed: int = 0
    source: str = "<fleet>"

    @property
    def count(self) -> int:
        return sum(k.count for k in self.servers)


def _keys(m: MMap, allowed: tuple[str, ...], where: str) -> None:
    for key in m:
        if key not in allowed:
            raise FleetError(
                f"{where}: unknown key '{key}'{did_you_mean(str(key), allowed)}", m.key_marks[key]
            )


def _map(value: Any, where: str, want: str, mark: Mark) -> MMap:
    if not isinstance(value, MMap):
        raise FleetError(f"{where} must be a mapping ({want}), got {value!r}", mark)
    return value


def _number(value: Any, where: str, mark: Mark, *, integer: bool = False) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value <= 0:
        raise FleetError(f"{where} must be a positive {'integer' if integer else 'number'}", mark)
    return value


def _path(value: Any, where: str, mark: Mark, base: Path) -> str:
    if not isinstance(value, str) or not value:
        raise FleetError(f"{where} must be a file path", mark)
    if value == LOCAL:
        return value
    p = Path(value) if Path(value).is_absolute() else base / value
    if not p.is_file():
        raise FleetError(f"{where}: no file '{value}' (read relative to the fleet file)", mark)
    return str(p)


def _rate(value: Any, where: str, mark: Mark) -> float:
    text = str(value).strip()
    text = text[: -len("/s")].strip() if text.endswith("/s") else text
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if isinstance(value, bool) or rate <= 0:
        raise FleetError(f"{where} must be requests per second like 5000/s, got {value!r}", mark)
    return rate


def _nic(raw: Any, where: str, mark: Mark) -> Nic:
    m = _map(raw, where, "bandwidth, latency", mark)
    _keys(m, NIC_KEYS, where)
    bw = parse_rate(m.get("bandwidth"))
    if bw is None:
        raise FleetError(
            f"{where}: 'bandwidth' must be a rate like 100Gb/s", m.mark_of("bandwidth")
        )
    lat = parse_time_ms(m.get("latency", 0))
    if lat is None:
        raise FleetError(f"{where}: 'latency' must be a time like 10us", m.mark_of("latency"))
    return Nic(bw, lat)


def _link(raw: Any, where: str, mark: Mark) -> LinkOverride:
    m = _map(raw, where, "between, bandwidth, latency", mark)
    _keys(m, LINK_KEYS, where)
    ends = m.get("between")
    if not (isinstance(ends, MSeq) and len(ends) == 2 and all(isinstance(e, str) for e in ends)):
        raise FleetError(f"{where}: 'between' must name two device ids", m.mark_of("between"))
    bw = lat = None
    if "bandwidth" in m and (bw := parse_rate(m["bandwidth"])) is None:
        raise FleetError(f"{where}: 'bandwidth' must be a rate like 25Gb/s", m.mark_of("bandwidth"))
    if "latency" in m and (lat := parse_time_ms(m["latency"])) is None:
        raise FleetError(f"{where}: 'latency' must be a time like 10us", m.mark_of("latency"))
    return LinkOverride((ends[0], ends[1]), bw, lat, m.mark)


def _server(name: Any, raw: Any, marks: tuple[Mark, Mark], base: Path) -> ServerKind:
    where = f"server kind '{name}'"
    m = _map(raw, where, "count, topology, cores, profiles, nic, links", marks[1])
    _keys(m, SERVER_KEYS, where)
    for key in ("count", "topology"):
        if key not in m:
            raise FleetError(f"{where}: '{key}' is required", m.mark)
    count = int(_number(m["count"], f"{where}: 'count'", m.mark_of("count"), integer=True))
    topo = _path(m["topology"], f"{where}: 'topology'", m.mark_of("topology"), base)
    cores = _map(m.get("cores", MMap()), f"{where}: 'cores'", "device id: cores", m.mark)
    for dev, n in cores.items():
        _number(n, f"{where}: cores of '{dev}'", cores.value_marks[dev], integer=True)
    profiles = m.get("profiles", [])
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise FleetError(f"{where}: 'profiles' must be a list of profile names or paths", m.mark)
    nic = _nic(m["nic"], f"{where}: 'nic'", m.mark_of("nic")) if "nic" in m else None
    links = m.get("links", MSeq())
    if not isinstance(links, MSeq):
        raise FleetError(f"{where}: 'links' must be a list", m.mark_of("links"))
    return ServerKind(
        str(name),
        count,
        topo,
        tuple((str(k), int(v)) for k, v in cores.items()),
        tuple(profiles),
        nic,
        tuple(_link(raw, f"{where}: link", links.item_marks[i]) for i, raw in enumerate(links)),
        marks[0],
    )


def _demand(raw: Any, mark: Mark, base: Path, i: int) -> Demand:
    where = f"mix[{i}]"
    m = _map(raw, where, "pipeline, rate, sizes", mark)
    _keys(m, MIX_KEYS, where)
    for key in ("pipeline", "rate"):
        if key not in m:
            raise FleetError(f"{where}: '{key}' is required", m.mark)
    pipeline = _path(m["pipeline"], f"{where}: 'pipeline'", m.mark_of("pipeline"), base)
    sizes = _map(m.get("sizes", MMap()), f"{where}: 'sizes'", "input: {height, ...}", m.mark)
    typical = []
    for name, t in sizes.items():
        t = _map(t, f"{where}: sizes of '{name}'", "height, width, bytes, chars", sizes.mark)
        _keys(t, SIZE_KEYS, f"{where}: sizes of '{name}'")
        for k, v in t.items():
            _number(v, f"{where}: sizes of '{name}': '{k}'", t.value_marks[k])
        typical.append((str(name), tuple((str(k), v) for k, v in t.items())))
    rate = _rate(m["rate"], f"{where}: 'rate'", m.mark_of("rate"))
    return Demand(pipeline, rate, tuple(typical), m.mark)


def load_fleet(path: str | Path) -> Fleet:
    """Read and check a fleet file (its topology and pipeline files are checked where used)."""
    doc = read_marked(path, FleetError)
    source, base = str(path), Path(path).resolve().parent
    doc = _map(doc, "a fleet file", "name, servers, mix", Mark(source, 1, 1))
    _keys(doc, TOP_KEYS, "fleet")
    for key in ("servers", "mix"):
        if key not in doc:
            raise FleetError(f"fleet: '{key}' is required", doc.mark)
    servers = _map(doc["servers"], "'servers'", "kind name: {count, topology}", doc.mark)
    if not servers:
        raise FleetError("'servers' must name at least one server kind", servers.mark)
    kinds = tuple(
        _server(k, v, (servers.key_marks[k], servers.value_marks[k]), base)
        for k, v in servers.items()
    )
    mix = doc["mix"]
    if not isinstance(mix, MSeq) or not mix:
        raise FleetError("'mix' must be a list of {pipeline, rate}", doc.mark_of("mix"))
    demands = tuple(_demand(raw, mix.item_marks[i], base, i) for i, raw in enumerate(mix))
    duration = parse_time_ms(doc.get("duration", "10s"))
    if not duration:
        raise FleetError("'duration' must be a time like 10s", doc.mark_of("duration"))
    seed = doc.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise FleetError("'seed' must be an integer", doc.mark_of("seed"))
    name = str(doc.get("name", Path(path).stem))
    return Fleet(name, kinds, demands, duration / 1e3, seed, source)
