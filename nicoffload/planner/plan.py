"""Plan: a placement of every node on a device, grouped into stages, with the transfers between.

A Plan is a value: built by the solver (or for one device), written to and read from JSON,
and executed by the runtime. Nothing in it is looked up again per batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, PlanError
from nicoffload.graph import Pipeline

PLAN_VERSION = 1


@dataclass(frozen=True)
class StagePlan:
    """Consecutive nodes (in topological order) on one device; the runtime fuses inside it."""

    name: str
    device: str  # device id in the topology: "cpu", "dpu0", "gpu0"
    kind: str  # cpu | dpu | gpu
    nodes: tuple[str, ...]
    predicted_ms_per_item: float | None = None


@dataclass(frozen=True)
class TransferPlan:
    """A tensor crossing from one stage to another over a link."""

    src_stage: str
    dst_stage: str
    tensor: str  # the Ref as text: "crop" or "tok.input_ids"
    transport: str  # inproc | shm | tcp | rdma | rdma-gpudirect | pcie
    bytes_per_item: int
    link: str | None = None
    predicted_ms_per_item: float | None = None


@dataclass(frozen=True)
class Predicted:
    latency_ms: float
    throughput_per_s: float
    host_cpu_ms_per_item: float


@dataclass(frozen=True)
class Plan:
    pipeline: str
    placement: dict[str, str]
    stages: tuple[StagePlan, ...]
    transfers: tuple[TransferPlan, ...] = ()
    objective: str = "throughput"
    predicted: Predicted | None = None
    topology: str = "local"
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Filled by the planner (absent from hand-made and single-device plans):
    ingress: str | None = None  # where request bytes arrive
    egress: str | None = None  # where the outputs are delivered (the model's GPU)
    io_transfers: tuple[TransferPlan, ...] = ()  # input -> first stage, last stage -> egress
    loads: dict[str, float] = field(default_factory=dict)  # resource -> ms of it per item
    explain: dict[str, Any] = field(default_factory=dict)  # why: bottleneck, runner-up, ...
    # how it was found: method, seconds, time_limit_s, and the proven relative gap of the
    # objective and of its tie-break (0: optimal; None: nothing proven)
    search: dict[str, Any] = field(default_factory=dict)
    # per stage that sends its outputs to another process (a DPU stage): scheme, slots,
    # slot_bytes, batch_max_size, batch_max_wait_ms (`planner.physical`): what the runtime uses
    physical: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["version"] = PLAN_VERSION
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any], source: str = "<plan>") -> Plan:
        try:
            if doc.get("version") != PLAN_VERSION:
                raise PlanError(
                    f"plan version {doc.get('version')!r} is not {PLAN_VERSION}", Mark(source, 1, 1)
                )
            pred = doc.get("predicted")
            return cls(
                pipeline=doc["pipeline"],
                placement=dict(doc["placement"]),
                stages=tuple(StagePlan(**{**s, "nodes": tuple(s["nodes"])}) for s in doc["stages"]),
                transfers=tuple(TransferPlan(**t) for t in doc.get("transfers", ())),
                objective=doc.get("objective", "throughput"),
                predicted=Predicted(**pred) if pred else None,
                topology=doc.get("topology", "local"),
                notes=tuple(doc.get("notes", ())),
                ingress=doc.get("ingress"),
                egress=doc.get("egress"),
                io_transfers=tuple(TransferPlan(**t) for t in doc.get("io_transfers", ())),
                loads=dict(doc.get("loads", {})),
                explain=dict(doc.get("explain", {})),
                search=dict(doc.get("search", {})),
                physical={k: dict(v) for k, v in doc.get("physical", {}).items()},
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise PlanError(f"not a nicoffload plan: {exc!r}", Mark(source, 1, 1)) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read the plan: {exc}", Mark(str(path), 1, 1)) from None
        return cls.from_json(doc, str(path))

    def stage_of(self, node: str) -> StagePlan:
        return next(s for s in self.stages if node in s.nodes)

    def check_matches(self, pipeline: Pipeline, source: str = "<plan>") -> None:
        """A plan made for another pipeline (or an older version of it) is refused."""
        names = {n.name for n in pipeline.nodes}
        if self.pipeline != pipeline.name or set(self.placement) != names:
            raise PlanError(
                f"the plan is for pipeline '{self.pipeline}' with nodes {sorted(self.placement)}, "
                f"not '{pipeline.name}' with nodes {sorted(names)}; plan it again",
                Mark(source, 1, 1),
            )


def device_kind(device: str) -> str:
    """'dpu0' -> 'dpu'; ids are a kind followed by an optional index or name."""
    return device.rstrip("0123456789").split(":", 1)[0].split("-", 1)[0]


def stages_for(
    pipeline: Pipeline, placement: dict[str, str]
) -> tuple[tuple[StagePlan, ...], tuple[TransferPlan, ...]]:
    """Cut the topological order into runs of nodes on the same device; list the crossing edges."""
    runs: list[tuple[str, list[str]]] = []
    for node in pipeline.nodes:
        dev = placement[node.name]
        if runs and runs[-1][0] == dev:
            runs[-1][1].append(node.name)
        else:
            runs.append((dev, [node.name]))
    stages = tuple(
        StagePlan(f"s{i}-{dev}", dev, device_kind(dev), tuple(names))
        for i, (dev, names) in enumerate(runs)
    )
    where = {n: s.name for s in stages for n in s.nodes}
    transfers = []
    for node in pipeline.nodes:
        for ref in node.inputs:
            if ref.is_input or where[ref.source] == where[node.name]:
                continue
            spec = pipeline.spec_of(ref)
            key = (where[ref.source], where[node.name], str(ref))
            if key not in {(t.src_stage, t.dst_stage, t.tensor) for t in transfers}:
                transfers.append(
                    TransferPlan(*key, transport="inproc", bytes_per_item=spec.typical_nbytes)
                )
    return stages, tuple(transfers)


def single_device_plan(pipeline: Pipeline, device: str = "cpu") -> Plan:
    """Every node on one device: the host-only plan, and the reference for split runs."""
    placement = {n.name: device for n in pipeline.nodes}
    stages, transfers = stages_for(pipeline, placement)
    return Plan(
        pipeline.name, placement, stages, transfers, objective="single-device", topology=device
    )
