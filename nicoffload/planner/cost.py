"""The cost model: a pipeline on a topology with profiles, reduced to arrays every solver shares.

Node v on device d costs `a + b * work(v)` core-ms per item (work from the TensorSpecs the
runtime will really see: a CPU/DPU decoder followed by antialiased resizes with room for it
decodes smaller, in the DCT domain, as `ops.decode.decoded_size` decides for its kernel too; a
GPU decoder decodes at full size and is priced so, while the one size each tensor has here is
the CPU/DPU decoder's). A fusable chain the runtime runs as one kernel costs that kernel's time
instead, where the runtime fuses it: within a stage, greedily from its first node (`fusion`).
A tensor crossing devices loads each hop of its route: `bytes / bandwidth` on the link, and
the transport's CPU time per byte on each CPU endpoint. The host runs its stages in threads
of one Python process, whose interpreter (the GIL) each host stage holds for a measured time per
item (`host_serial`): a serial resource shared by them all. Pure functions of their inputs: no
I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from nicoffload.graph import Dim, Node, Pipeline, TensorSpec
from nicoffload.ops import kernel_consumers
from nicoffload.ops.decode import DCT_SCALING_KINDS, decoded_size
from nicoffload.planner import fusion
from nicoffload.planner.side import decoder_shares, gpu_progressive
from nicoffload.profiles import Profile
from nicoffload.topology import Topology

BUFFER_SLOTS = 2  # each node's batch buffers are double-buffered by the runtime


@dataclass(frozen=True)
class Catalog:
    """Which kernels exist: op -> device kinds, and per kind the fused chains (longest first)."""

    single: Mapping[str, frozenset[str]]
    fused: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)

    @classmethod
    def from_registry(cls) -> Catalog:
        from nicoffload import ops

        single = {name: frozenset(ops.kernels_for(name)) for name in ops.op_names()}
        fused = {kind: tuple(k.ops for k in ops.fused_kernels(kind)) for kind in ops.DEVICES}
        return cls(single, fused)

    def kinds(self, op: str) -> frozenset[str]:
        return self.single.get(op, frozenset())


@dataclass(frozen=True)
class TensorRef:
    """A tensor that may cross devices: a pipeline input (src -1, at the ingress) or a node output."""

    label: str
    src: int
    consumers: tuple[int, ...]
    output: bool  # delivered to the egress device
    nbytes: float


@dataclass(frozen=True)
class Group:
    """Consecutive nodes the runtime may fuse into one kernel when they share a device: it does
    when the greedy cover of their run (stage) takes them, as `rows` says (`fusion.table`;
    None: whenever they share a device). Its inner nodes are never outputs."""

    nodes: tuple[int, ...]
    key: str
    delta: np.ndarray  # (D,) fused cost minus the nodes' own costs; nan where it does not apply
    s0: int = 0  # the run start that rows[0] stands for (and any earlier one)
    rows: np.ndarray | None = field(default=None, compare=False)  # (i - s0 + 1, e1 - j + 1)

    def applies(self, start, end) -> np.ndarray:
        """Whether a run of nodes start..end on one device (start <= first, end >= last node)
        runs this group fused, elementwise."""
        start, end = np.asarray(start), np.asarray(end)
        if self.rows is None:
            return np.ones(np.broadcast(start, end).shape, dtype=bool)
        r = np.clip(start - self.s0, 0, self.rows.shape[0] - 1)
        c = np.clip(end - self.nodes[-1], 0, self.rows.shape[1] - 1)
        return self.rows[r, c]


@dataclass(frozen=True)
class CostModel:
    nodes: tuple[str, ...]  # topological order
    devices: tuple[str, ...]
    resources: tuple[str, ...]  # the devices, then directed hops "a->b"
    divisor: np.ndarray  # (R,) a device's parallel capacity; 1 for a link
    cost: np.ndarray  # (n, D) core-ms per item; inf where the node cannot go
    why_not: Mapping[tuple[int, int], str]  # (node, device) -> why it cannot go there
    work: np.ndarray  # (n,) the cost feature actually used
    groups: tuple[Group, ...]
    refs: tuple[TensorRef, ...]
    route_load: np.ndarray  # (D, D, R) load per byte sent s -> d: link ms, endpoint core-ms
    route_fixed: np.ndarray  # (D, D, R) and per item whatever its size: endpoint core-ms
    route_ms: np.ndarray  # (D, D) latency of the route
    route_ms_per_byte: np.ndarray  # (D, D)
    mem: np.ndarray  # (n,) bytes of buffers a node needs on its device
    mem_cap: np.ndarray  # (D,) inf where not limited
    host: np.ndarray  # (D,) True for host CPU devices
    ingress: int
    egress: int
    # the host runtime's own CPU per item, on the host that runs the Session (R,): the same
    # for every placement, so it is left out of the search and added to the plan's figures
    # (`runtime_load`); folding it into the solvers is the planner issue's (#20)
    base: np.ndarray | None = None
    # (2, D) ms per item that each stage on device d holds the host process's interpreter
    # (the GIL), its per-batch part shared by a batch's items, when the runtime's fast path
    # runs the plan (row 0) or its general path (row 1; `evaluate.fast_path`): the CPU that
    # runs the Session and its GPUs (whose stages that process feeds), all sharing it
    # (`host_serial`; evaluate: Metrics.serial); 0 on other devices (an agent is its own
    # process).
    # evaluate counts it, so the DP's final choice and every plan's figures do; the per-node
    # MILP has rows for it (`milp._add_serial`); the branch classes' program leaves it out,
    # and where it binds on their plan the per-node MILP decides (`milp._serial_binds`)
    serial: np.ndarray | None = None
    kinds: tuple[str, ...] = ()  # (D,) each device's kind: cpu | dpu | gpu
    # (node, device, resource, core-ms per item): what node v on device d also costs another
    # resource (`planner.side`: a GPU decoder's progressive JPEGs on the host's threads)
    side: tuple[tuple[int, int, int, float], ...] = ()

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def allowed(self) -> np.ndarray:
        return np.isfinite(self.cost)

    def ref_load(self, r: TensorRef) -> np.ndarray:
        """(D, D, R) what sending `r` s -> d loads each resource per item: its bytes on the
        links and at each CPU end, and each end's per-batch cost shared by a batch's items."""
        return r.nbytes * self.route_load + self.route_fixed

    def ref_time(self, r: TensorRef, s: int, d: int) -> float:
        return (
            0.0 if s == d else float(self.route_ms[s, d] + r.nbytes * self.route_ms_per_byte[s, d])
        )


# -- effective shapes ---------------------------------------------------------------------------


def _with_typical(spec: TensorSpec, hw: tuple[int, int]) -> TensorSpec:
    dims = tuple(
        Dim(d.name, v) if isinstance(d, Dim) else v for d, v in zip(spec.shape[:2], hw, strict=True)
    )
    return replace(spec, shape=dims + tuple(spec.shape[2:]))


def dct_decoded_hw(node: Node, consumers: Iterable) -> tuple[int, int] | None:
    """The typical size a CPU/DPU decoder really produces when it decodes smaller in the DCT
    domain, or None when it decodes at full size. Decided by `ops.decode.decoded_size`, the
    function its kernel calls per image, from the consumers the kernel is built with
    (`ops.kernel_consumers`); a PNG (Pillow) is always decoded at full size."""
    if node.op != "decode_image" or node.in_specs[0].hint("format") == "png":
        return None
    h, w = node.out.typical_shape[:2]
    hw = decoded_size(node.params, tuple(consumers), h, w)
    return None if hw == (h, w) else hw


def effective_specs(
    pipeline: Pipeline,
) -> dict[str, tuple[tuple[TensorSpec, ...], dict[str, TensorSpec]]]:
    """Per node, (in_specs, out_specs) with the typical sizes the runtime will see."""
    out: dict[str, tuple[tuple[TensorSpec, ...], dict[str, TensorSpec]]] = {}
    for node in pipeline.nodes:
        ins = tuple(
            spec if r.is_input else out[r.source][1][r.port]
            for r, spec in zip(node.inputs, node.in_specs, strict=True)
        )
        outs = dict(node.out_specs)
        hw = dct_decoded_hw(node, kernel_consumers(pipeline, node.name))
        if hw is not None:
            outs = {k: _with_typical(v, hw) for k, v in outs.items()}
        out[node.name] = (ins, outs)
    return out


def effective_work(pipeline: Pipeline) -> dict[str, float]:
    specs = effective_specs(pipeline)
    return {n.name: float(n.opdef().work(n.params, *specs[n.name])) for n in pipeline.nodes}


def encoded_bytes(pipeline: Pipeline) -> dict[str, float]:
    """Per node, its second cost feature (`ops.OpDef.encoded`: the encoded bytes a decoder
    reads) at the typical sizes, 0 for ops without one."""
    specs = effective_specs(pipeline)
    out = {}
    for n in pipeline.nodes:
        feature = n.opdef().encoded
        out[n.name] = 0.0 if feature is None else float(feature(n.params, *specs[n.name]))
    return out


def full_size_work(pipeline: Pipeline) -> dict[str, float]:
    """The work of each decoder that DCT-scales (`dct_decoded_hw`) when it decodes at full
    size instead, as its kernels on kinds outside `ops.decode.DCT_SCALING_KINDS` do."""
    specs = effective_specs(pipeline)
    return {
        n.name: float(n.opdef().work(n.params, specs[n.name][0], n.out_specs))
        for n in pipeline.nodes
        if dct_decoded_hw(n, kernel_consumers(pipeline, n.name)) is not None
    }


def chain_work(pipeline: Pipeline, names: Iterable[str]) -> float:
    """The work of a fused chain: a crop inside it limits what the ops before it compute to
    the crop window (a fused resize+crop resamples only the pixels it keeps)."""
    work, specs = effective_work(pipeline), effective_specs(pipeline)
    names = list(names)
    total = 0.0
    for i, name in enumerate(names):
        share = 1.0
        for later in names[i + 1 :]:
            if pipeline.node(later).op == "center_crop":
                kept = math.prod(specs[later][1]["out"].typical_shape)
                share = min(
                    1.0, kept / max(1, math.prod(next(iter(specs[name][1].values())).typical_shape))
                )
                break
        total += work[name] * share
    return total


# -- building ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routes:
    """The resources of a topology (devices, then directed hops) and what each route loads."""

    resources: tuple[str, ...]
    divisor: np.ndarray  # (R,) a device's parallel capacity; 1 for a link
    load: np.ndarray  # (D, D, R) per byte sent s -> d: link ms, and endpoint CPU core-ms
    fixed: np.ndarray  # (D, D, R) per item: endpoint CPU core-ms of the per-batch costs
    ms: np.ndarray  # (D, D) latency of the route
    ms_per_byte: np.ndarray  # (D, D)


def routes(topology: Topology, batch_size: int = 1) -> Routes:
    ids = topology.ids
    paths = {(a, b): topology.route(a, b) for a in ids for b in ids}
    hops = sorted(
        {h.name for path in paths.values() for h in path},
        key=lambda name: tuple(ids.index(e) for e in name.split("->")),
    )
    resources = (*ids, *hops)
    D, R = len(ids), len(resources)
    load = np.zeros((D, D, R))
    fixed = np.zeros((D, D, R))
    ms = np.zeros((D, D))
    per_byte = np.zeros((D, D))
    for (a, b), path in paths.items():
        s, t = ids.index(a), ids.index(b)
        for hop in path:
            link = hop.link
            ms[s, t] += link.latency_ms
            per_byte[s, t] += 1e3 / link.bandwidth
            load[s, t, resources.index(hop.name)] += 1e3 / link.bandwidth
            for end in (hop.src, hop.dst):
                if topology.device(end).kind != "gpu":
                    load[s, t, ids.index(end)] += link.cpu_ns_per_byte * 1e-6
                    fixed[s, t, ids.index(end)] += link.cpu_us_per_batch * 1e-3 / batch_size
    divisor = np.array([d.capacity for d in topology.devices] + [1.0] * len(hops))
    return Routes(resources, divisor, load, fixed, ms, per_byte)


def _groups(
    pipeline: Pipeline,
    topology: Topology,
    profiles: Mapping[str, Profile],
    catalog: Catalog,
    cost: np.ndarray,
    encoded: Mapping[str, float],
    share: Mapping[str, float],
) -> list[Group]:
    """A group per fusable window per device kind with its fused kernel: on the devices of
    that kind it runs fused, priced by the profile's entry for the chain (at its first node's
    `encoded` bytes), else (no entry) as its nodes' sum; nan on the other devices."""
    names = [n.name for n in pipeline.nodes]
    kinds = sorted({dev.kind for dev in topology.devices})
    found = {kind: fusion.windows(pipeline, catalog.fused.get(kind, ())) for kind in kinds}
    cut = fusion.cuts(len(names), (w for ws in found.values() for w in ws))
    groups = []
    for kind in kinds:
        for i, j in found[kind]:
            window = tuple(range(i, j + 1))
            key = "+".join(pipeline.nodes[v].op for v in window)
            fused_work = chain_work(pipeline, [names[v] for v in window])
            delta = np.full(cost.shape[1], np.nan)
            for d, dev in enumerate(topology.devices):
                entry = profiles[dev.id].kernel(key) if dev.id in profiles else None
                own = cost[list(window), d].sum()
                if dev.kind == kind and np.isfinite(own):
                    delta[d] = (
                        0.0
                        if entry is None
                        else max(
                            0.0,
                            _fused_ms(
                                entry, profiles[dev.id], pipeline, i, fused_work, encoded, share
                            ),
                        )
                        - own
                    )
            s0, rows = fusion.table(found[kind], (i, j), cut)
            groups.append(Group(window, key, delta, s0, rows))
    return groups


def _fused_ms(entry, profile, pipeline, i, work, encoded, share) -> float:
    """A fused chain's ms per item, from node i: a chain led by a decoder pays its
    progressive items at the decoder's `progressive_x` when its own entry has none."""
    head = pipeline.nodes[i]
    own = profile.kernel(head.op)
    if entry.progressive_x is None and own is not None and own.progressive_x is not None:
        entry = replace(entry, progressive_x=own.progressive_x)
    return entry.ms(work, encoded[head.name], share[head.name])


def build_model(
    pipeline: Pipeline,
    topology: Topology,
    profiles: Mapping[str, Profile],
    catalog: Catalog,
) -> CostModel:
    """Reduce the planning problem to arrays. `profiles` maps device id -> its Profile."""
    ids = topology.ids
    D = len(ids)
    rt = routes(topology, pipeline.batch_max_size)
    _agent_ends(rt, topology, profiles, pipeline.batch_max_size)
    work_by_name = effective_work(pipeline)
    names = [n.name for n in pipeline.nodes]
    work = np.array([work_by_name[n] for n in names])
    full = full_size_work(pipeline)
    encoded = encoded_bytes(pipeline)
    share, leaves = decoder_shares(pipeline)
    cost = np.full((len(names), D), np.inf)
    why: dict[tuple[int, int], str] = {}
    for v, node in enumerate(pipeline.nodes):
        kinds = catalog.kinds(node.op)
        for d, dev in enumerate(topology.devices):
            entry = profiles[dev.id].kernel(node.op) if dev.id in profiles else None
            if dev.kind not in kinds:
                have = ", ".join(sorted(kinds)) or "none"
                why[v, d] = f"op '{node.op}' has no {dev.kind} kernel (kernels exist for: {have})"
            elif entry is None:
                why[v, d] = f"the profile of '{dev.id}' has no entry for '{node.op}'"
            else:
                scaled = node.name not in full or dev.kind in DCT_SCALING_KINDS
                pixels = work[v] if scaled else full[node.name]
                cost[v, d] = max(0.0, entry.ms(pixels, encoded[node.name], share[node.name]))
    pixels = {n: float(full.get(n, work_by_name[n])) for n in names}
    side = gpu_progressive(
        pipeline,
        topology,
        profiles,
        cost,
        pixels,
        encoded,
        (share, leaves),
        session_host(topology),
    )
    groups = _groups(pipeline, topology, profiles, catalog, cost, encoded, share)
    specs = effective_specs(pipeline)
    outputs = {str(r) for r in pipeline.outputs.values()}
    refs: list[TensorRef] = []
    for label, spec in pipeline.inputs.items():
        consumers = tuple(
            v
            for v, n in enumerate(pipeline.nodes)
            if any(r.is_input and r.source == label for r in n.inputs)
        )
        refs.append(TensorRef(label, -1, consumers, False, float(spec.typical_nbytes)))
    for u, node in enumerate(pipeline.nodes):
        for port, spec in specs[node.name][1].items():
            label = node.name if port == "out" else f"{node.name}.{port}"
            consumers = tuple(
                v
                for v, n in enumerate(pipeline.nodes)
                if any(
                    not r.is_input and r.source == node.name and r.port == port for r in n.inputs
                )
            )
            if consumers or label in outputs:
                refs.append(
                    TensorRef(label, u, consumers, label in outputs, float(spec.typical_nbytes))
                )
    mem = np.zeros(len(names))
    for v, node in enumerate(pipeline.nodes):
        ins, outs = specs[node.name]
        nbytes = sum(s.typical_nbytes for s in ins) + sum(s.typical_nbytes for s in outs.values())
        mem[v] = nbytes * pipeline.batch_max_size * BUFFER_SLOTS
    return CostModel(
        nodes=tuple(names),
        devices=ids,
        resources=rt.resources,
        divisor=rt.divisor,
        cost=cost,
        why_not=why,
        work=work,
        groups=tuple(groups),
        refs=tuple(refs),
        route_load=rt.load,
        route_fixed=rt.fixed,
        route_ms=rt.ms,
        route_ms_per_byte=rt.ms_per_byte,
        mem=mem,
        mem_cap=np.array([float(d.memory) if d.memory else np.inf for d in topology.devices]),
        host=np.array([d.kind == "cpu" for d in topology.devices]),
        ingress=ids.index(topology.ingress),
        egress=ids.index(topology.egress),
        base=runtime_load(topology, profiles, len(rt.resources), pipeline.batch_max_size),
        serial=host_serial(topology, profiles, pipeline.batch_max_size),
        kinds=tuple(d.kind for d in topology.devices),
        side=side,
    )


def agent_ms_per_item(prof: Profile | None, batch_size: int) -> float:
    """The DPU agent's own CPU per item outside its kernels and transfers, in ms, at full
    batches of `batch_size`: its profile's `agent_us_per_item` (parsing requests, batching, row
    status, forwarding) plus `agent_us_per_batch` shared by a batch's items; 0 without them."""
    if prof is None:
        return 0.0
    per_item, per_batch = prof.agent_us_per_item or 0.0, prof.agent_us_per_batch or 0.0
    return (per_item + per_batch / max(1, batch_size)) * 1e-3


def _agent_ends(
    rt: Routes, topology: Topology, profiles: Mapping[str, Profile], batch_size: int
) -> None:
    """The DPU agent's own CPU per item outside its kernels and transfers
    (`agent_ms_per_item`), as CPU on the DPU's cores (divided by its capacity like its
    kernels). A DPU pays half on each tensor that enters it and half on each that leaves: a
    stage with one input and one output pays it once. A DPU that is the ingress receives every
    item whatever the placement: it pays it in full in its `runtime_load` instead. Devices
    whose profile lacks it pay nothing."""
    ids = topology.ids
    for d, dev in enumerate(topology.devices):
        own = agent_ms_per_item(profiles.get(dev.id), batch_size)
        if dev.kind != "dpu" or dev.id == topology.ingress or not own:
            continue
        half = own / 2
        for other in range(len(ids)):
            if other != d:
                rt.fixed[d, other, d] += half
                rt.fixed[other, d, d] += half


def session_host(topology: Topology):
    """The CPU device that runs the Session (the ingress when it is a CPU, else the first CPU
    device), or None without one."""
    ingress = topology.device(topology.ingress)
    if ingress.kind == "cpu":
        return ingress
    return next((d for d in topology.devices if d.kind == "cpu"), None)


def host_serial(
    topology: Topology, profiles: Mapping[str, Profile], batch_size: int
) -> np.ndarray | None:
    """(2, D) ms per item a stage holds the host process's interpreter, on the runtime's fast
    path and on its general path: on the CPU that runs the Session and on each GPU (fed by
    that process), its profile's `serial_us_per_item + serial_us_per_batch / batch size`
    (`serial_general_...` on the general path; the fast path's figures where a profile has
    only those), 0 where the profile lacks them (measured before they were) and on other
    devices; None when no device has them (no cap, as before).

    On the general path a DPU stage is the host's work too: the host process hands each
    batch's rows to the agent and puts what comes back into the batch, row by row
    (`runtime.dpu_part`), as it does around a host stage's kernels: it costs the Session's
    CPU's general figure. (On the fast path the leading DPU stage's rows are the runtime's
    own per-item cost, `runtime_load`.) Without it the planner sent a GPU stage's output to
    the DPU for its last node on the H200 host, at 0.35% less GPU load, predicted 17,205
    items/s; it ran at 5,028."""
    host = session_host(topology)
    out = np.zeros((2, len(topology.ids)))
    for d, dev in enumerate(topology.devices):
        prof = profiles.get(dev.id)
        if (host is None or dev.id != host.id) and dev.kind != "gpu":
            continue
        if prof is None or prof.serial_us_per_item is None or prof.serial_us_per_batch is None:
            continue
        fast = (prof.serial_us_per_item, prof.serial_us_per_batch)
        general = (prof.serial_general_us_per_item, prof.serial_general_us_per_batch)
        for path, (a, b) in enumerate((fast, general if None not in general else fast)):
            out[path, d] = (a + b / max(1, batch_size)) * 1e-3
    if host is not None:
        at = topology.ids.index(host.id)
        for d, dev in enumerate(topology.devices):
            if dev.kind == "dpu":
                out[1, d] = out[1, at]
    return out if out.any() else None


def runtime_load(
    topology: Topology, profiles: Mapping[str, Profile], resources: int, batch_size: int = 1
) -> np.ndarray:
    """(R,) core-ms per item whatever the placement: the host runtime's, on the host CPU that
    runs it (the ingress when it is a CPU, else the first CPU device; from that device's
    profile, 0 without one), and the agent's own on a DPU that is the ingress (at batches of
    `batch_size`)."""
    base = np.zeros(resources)
    ingress = topology.device(topology.ingress)
    if ingress.kind == "dpu":
        # the agent that receives every item (`_agent_ends`)
        own = agent_ms_per_item(profiles.get(ingress.id), batch_size)
        base[topology.ids.index(ingress.id)] += own
    host = session_host(topology)
    if host is None:
        return base
    prof = profiles.get(host.id)
    if prof is not None and prof.runtime_us_per_item is not None:
        base[topology.ids.index(host.id)] = prof.runtime_us_per_item * 1e-3
    return base
