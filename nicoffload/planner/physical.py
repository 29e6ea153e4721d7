"""The Plan's physical decisions: for each stage whose outputs cross to another process (a DPU
stage, through its agent), the transport scheme, the receiver's ring (slots x slot bytes) and
the batch the agent forms; decided once, when the plan is made (or completed for a plan file
written before), and read by the runtime from the Plan alone.

A slot holds one batch of what the stage sends on (`leaving`): every static tensor at its
size, every dynamic one at 4x its typical size (a larger item fails alone, as
`slot_overflow`, and is run on the host), each tensor aligned, each row's offset aligned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from nicoffload.errors import DeviceError, Mark, PlanError
from nicoffload.graph import Pipeline, Ref, TensorSpec
from nicoffload.planner.plan import Plan, StagePlan
from nicoffload.topology import Topology
from nicoffload.transport.frame import MAX_PAYLOAD
from nicoffload.transport.slots import ALIGN

RING_SLOTS = 4  # batches a receiver holds at once: in flight on the wire, waiting, being read
DYNAMIC_ROOM = 4  # a dynamic tensor's room in a slot, as a multiple of its typical size
SCHEMES = ("tcp", "shm", "rdma")


def leaving(pipeline: Pipeline, stage: StagePlan) -> list[str]:
    """Value keys a stage produces that later stages or the outputs read."""
    inside = set(stage.nodes)
    keys = {str(r) for n in pipeline.nodes if n.name not in inside for r in n.inputs}
    keys |= {str(r) for r in pipeline.outputs.values()}
    return sorted(k for k in keys if k.split(".", 1)[0] in inside)


def spec_of_key(pipeline: Pipeline, key: str) -> TensorSpec:
    name, _, port = key.partition(".")
    return pipeline.spec_of(Ref(name, port or "out"))


def slot_bytes(specs: Mapping[str, TensorSpec], batch: int) -> int:
    """One slot's bytes for a batch of `batch` items of these tensors."""
    return sum(
        -(-batch * s.typical_nbytes * (1 if s.static else DYNAMIC_ROOM) // ALIGN) * ALIGN
        + batch * ALIGN
        for s in specs.values()
    )


def scheme(plan: Plan, stage: StagePlan, topology: Topology | None) -> str:
    """What the stage forwards over: its outgoing transfer's link (the planner names it; to the
    next stage, else to the egress), else
    the topology's link between the two devices, else tcp."""
    out = next(
        (t for t in (*plan.transfers, *plan.io_transfers) if t.src_stage == stage.name), None
    )
    link = out.transport.split("+")[0] if out is not None else "tcp"
    if link == "inproc" and out is not None and topology is not None:
        dst = next(s.device for s in plan.stages if s.name == out.dst_stage)
        ends = {stage.device, dst}
        link = next(
            (ln.toward(dst).transport for ln in topology.links if {ln.a, ln.b} == ends), "tcp"
        )
    return "rdma" if link.startswith("rdma") else "shm" if link == "shm" else "tcp"


def stage_physical(
    pipeline: Pipeline, plan: Plan, stage: StagePlan, topology: Topology | None
) -> dict[str, int | float | str]:
    batch = pipeline.batch_max_size
    specs = {k: spec_of_key(pipeline, k) for k in leaving(pipeline, stage)}
    size = slot_bytes(specs, batch)
    if size > MAX_PAYLOAD:
        fits = next((b for b in range(batch - 1, 0, -1) if slot_bytes(specs, b) <= MAX_PAYLOAD), 0)
        raise DeviceError(
            f"stage '{stage.name}' on {stage.device}: a batch of what it sends on ({len(specs)} "
            f"tensors, {batch} items, room for {DYNAMIC_ROOM}x each dynamic tensor's typical "
            f"size) needs {size / 2**30:.1f} GiB per slot, past the wire format's "
            f"{MAX_PAYLOAD / 2**30:.0f} GiB: "
            + (
                f"set `batch: {{max_size: {fits}}}` in the pipeline, or plan it elsewhere"
                if fits
                else "plan it elsewhere (not even one item fits)"
            )
        )
    return {
        "scheme": scheme(plan, stage, topology),
        "slots": RING_SLOTS,
        "slot_bytes": size,
        "batch_max_size": batch,
        "batch_max_wait_ms": pipeline.batch_max_wait_ms,
    }


MAX_SLOTS = 64
_FIELDS = ("scheme", "slots", "slot_bytes", "batch_max_size", "batch_max_wait_ms")
# optional: the share of a batch's rows the host runs the stage for while its agent is busy
# (`planner.assist`)
_OPTIONAL = ("host_share",)


def check(plan: Plan, source: str = "<plan>") -> None:
    """PlanError for a plan whose physical decisions the runtime cannot take as they are: an
    entry for a stage that is not a DPU stage of the plan, an unknown or missing field, a
    scheme that is not a transport's, counts and sizes out of range (a plan file edited by
    hand, or not one of ours)."""
    dpu = {s.name: s for s in plan.stages if s.kind == "dpu"}
    for name, entry in plan.physical.items():
        where = f"physical['{name}']"
        if name not in dpu:
            raise PlanError(f"{where}: the plan has no DPU stage '{name}'", Mark(source, 1, 1))
        if not isinstance(entry, dict) or not set(_FIELDS) <= set(entry) <= {*_FIELDS, *_OPTIONAL}:
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise PlanError(
                f"{where}: fields {list(_FIELDS)} (and optionally {list(_OPTIONAL)}), got {got}",
                Mark(source, 1, 1),
            )
        sch, slots, size = entry["scheme"], entry["slots"], entry["slot_bytes"]
        batch, wait = entry["batch_max_size"], entry["batch_max_wait_ms"]
        problem = (
            f"scheme {sch!r} is none of {', '.join(SCHEMES)}"
            if sch not in SCHEMES
            else f"slots {slots!r} must be an integer 1-{MAX_SLOTS}"
            if type(slots) is not int or not 1 <= slots <= MAX_SLOTS
            else f"slot_bytes {size!r} must be an integer 1-{MAX_PAYLOAD}"
            if type(size) is not int or not 1 <= size <= MAX_PAYLOAD
            else f"batch_max_size {batch!r} must be a positive integer"
            if type(batch) is not int or batch < 1
            else f"batch_max_wait_ms {wait!r} must be a number >= 0"
            if type(wait) not in (int, float) or not 0 <= wait < float("inf")
            else f"host_share {entry['host_share']!r} must be a number from 0 up to 1"
            if type(entry.get("host_share", 0.0)) not in (int, float)
            or not 0 <= entry.get("host_share", 0.0) < 1
            else "host_share is for the plan's first stage only (the host runs that stage for "
            "a share of the items while its agent is busy)"
            if entry.get("host_share") and name != plan.stages[0].name
            else None
        )
        if problem:
            raise PlanError(f"{where}: {problem}", Mark(source, 1, 1))


def complete(pipeline: Pipeline, plan: Plan, topology: Topology | None) -> Plan:
    """The plan with the physical decisions of each DPU stage it lacks (a plan file written
    before they were part of it, a hand-made plan); DeviceError for a stage whose batch cannot
    fit one slot, PlanError for decisions the runtime cannot take (`check`)."""
    check(plan)
    physical = dict(plan.physical)
    for stage in plan.stages:
        if stage.kind == "dpu" and stage.name not in physical:
            physical[stage.name] = stage_physical(pipeline, plan, stage, topology)
    if physical == plan.physical:
        return plan
    return dataclasses.replace(plan, physical=physical)


def ring_slots(plan: Plan, stage: StagePlan) -> int:
    """The receiver ring's slots of DPU stage `stage`, so the batches it may hold at its agent
    and on the way back at once: the plan's decision, else the one `complete` makes."""
    return int(plan.physical.get(stage.name, {}).get("slots", RING_SLOTS))


def host_share(plan: Plan, stage: StagePlan) -> float:
    """The share of a batch's rows the host runs DPU stage `stage` for while its agent is busy
    (host assist: the planner decides it, `planner.assist`; absent: 0, none)."""
    return float(plan.physical.get(stage.name, {}).get("host_share", 0.0))


def with_host_share(plan: Plan, share: float) -> Plan:
    """The plan with host assist at `share` for its leading DPU stage (PlanError where it has
    none)."""
    first = plan.stages[0] if plan.stages else None
    if first is None or first.kind != "dpu" or first.name not in plan.physical:
        raise PlanError("host assist needs a plan whose first stage is a DPU stage")
    entry = {**plan.physical[first.name], "host_share": round(float(share), 6)}
    return dataclasses.replace(plan, physical={**plan.physical, first.name: entry})


def of_stage(plan: Plan, stage: StagePlan) -> dict[str, int | float | str]:
    """The stage's physical decisions (KeyError for a plan not `complete`d)."""
    return plan.physical[stage.name]
