"""What a run is: its plan and devices (`prepare`), the agents serving its DPU stages
(`open_fronts`), and what it returns (`RunResult`, with `RunStats`, the `run --json` shape).
`nicoffload.session` runs it: `nicoffload.open` / `nicoffload.run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.errors import DeviceError, Mark, UserError
from nicoffload.graph import Pipeline, load_pipeline
from nicoffload.planner.plan import Plan
from nicoffload.runtime.executor import ItemFailure
from nicoffload.runtime.remote import RemoteFront
from nicoffload.topology import Topology


@dataclass
class RunStats:
    """What a run measured. `to_json()` is the document `nicoffload run --json` prints."""

    items: int = 0
    errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)  # reason -> its first item's
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    host_cpu_s: float = 0.0
    placement: dict[str, str] = field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)
    failover: str | None = None  # why the DPU agent's items were taken back to the host
    # items whose DPU stage the host ran while the agent was busy (the plan's host assist)
    assisted: int = 0
    batches: int = 0
    setup_s: float = 0.0  # opening the session (agent start, LOAD, binding): not per item
    predicted: dict[str, float] | None = None  # the plan's (Predicted), where it has one

    @property
    def throughput_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s else 0.0

    @property
    def host_cpu_ms_per_item(self) -> float:
        return self.host_cpu_s * 1e3 / self.items if self.items else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "errors": self.errors,
            "errors_by_reason": dict(sorted(self.errors_by_reason.items())),
            "error_examples": dict(sorted(self.error_examples.items())),
            "throughput_per_s": round(self.throughput_per_s, 2),
            "latency_ms": {
                "p50": round(self.latency_ms(50), 3),
                "p99": round(self.latency_ms(99), 3),
            },
            "placement": self.placement,
            "stages": self.stages,
            "transfers": self.transfers,
            "failover": self.failover,
            "assisted": self.assisted,
            "host_cpu_ms_per_item": round(self.host_cpu_ms_per_item, 4),
            "wall_s": round(self.wall_s, 4),
            "batches": self.batches,
            "setup_s": round(self.setup_s, 4),
            "predicted": self.predicted,
        }


@dataclass
class RunResult:
    """Outputs in item order (failed items' rows are zero), which items succeeded, and stats."""

    names: list[str]
    outputs: dict[str, Any]
    ok: np.ndarray
    failures: list[ItemFailure]
    stats: RunStats
    on_gpu: dict[str, Any] = field(default_factory=dict, repr=False)  # CUDA tensors

    def torch(self) -> dict[str, Any]:
        """The static outputs as torch tensors: those a GPU stage produced stay on the GPU;
        the others share memory with the arrays (DLPack)."""
        try:
            import torch
        except ImportError as exc:
            from nicoffload.errors import MissingDependency

            raise MissingDependency("torch", "gpu", "RunResult.torch()") from exc
        host = {
            k: torch.from_dlpack(v) for k, v in self.outputs.items() if isinstance(v, np.ndarray)
        }
        return host | self.on_gpu


@dataclass(frozen=True)
class Prepared:
    """What a run needs besides its items: the pipeline, its plan, and the topology's devices."""

    pipeline: Pipeline
    plan: Plan
    topology: Topology | None = None
    token_file: str | Path | None = None  # the token of a real (not emulated) DPU agent


def prepare(
    pipeline: Pipeline | str | Path,
    plan: Plan | str | Path | None = None,
    topology: Topology | str | Path | None = None,
    token_file: str | Path | None = None,
    typical: Mapping[str, Mapping[str, int]] | None = None,
    *,
    host_assist: bool = False,
) -> Prepared:
    """The pipeline and the plan to run it with: the given plan, else one planned now (priced
    at `typical`, the sizes of the run's inputs, where known: `sizes.typical_of`).

    Without a topology the local machine is planned for: the host CPU plus an emulated DPU
    (a local agent on loopback, pinned to a share of the cores), and the GPU if CUDA works.
    """
    from nicoffload.topology import load_topology, local_topology

    if not isinstance(pipeline, Pipeline):
        pipeline = load_pipeline(pipeline)
    if isinstance(topology, (str, Path)):
        topology = load_topology(topology)
    source: str | None = None  # where a given plan came from: its devices are checked
    if plan is None:
        from nicoffload.planner import plan_for

        topology = topology if topology is not None else local_topology()
        plan = plan_for(priced_at(pipeline, typical), topology, host_assist=host_assist)
        if typical:
            plan = dataclasses.replace(plan, notes=(*plan.notes, typical_note(typical)))
    elif not isinstance(plan, Plan):
        source = str(plan)
        plan = Plan.load(plan)
        plan.check_matches(pipeline, source)
    else:
        source = "<plan>"
    if topology is None and plan.topology == "local":
        topology = local_topology()
    from nicoffload.planner import physical

    # a plan file written before the physical decisions were in plans gets them now
    plan = physical.complete(pipeline, plan, topology)
    prep = Prepared(pipeline, plan, topology, token_file)
    if source is not None:
        check_plan_devices(prep, source)
    return prep


def priced_at(pipeline: Pipeline, typical: Mapping[str, Mapping[str, int]] | None) -> Pipeline:
    """The pipeline the planner prices: with the inputs' measured sizes, where known."""
    from nicoffload.graph import with_typical

    return with_typical(pipeline, typical) if typical else pipeline


def typical_note(typical: Mapping[str, Mapping[str, int]]) -> str:
    from nicoffload.sizes import describe

    return describe(typical)


def check_plan_devices(prep: Prepared, plan_file: str) -> None:
    """A plan that places a stage on a device the topology lacks is the user's mistake: the
    plan was made for another topology. Its physical decisions are checked here too."""
    from nicoffload.planner import physical

    physical.check(prep.plan, plan_file)
    topo = prep.topology
    for st in prep.plan.stages:
        if topo is not None and st.device in topo.ids:
            continue
        if topo is None and st.kind != "dpu":  # the host and its GPU need no topology
            continue
        what = f"the plan places stage '{st.name}' ({', '.join(st.nodes)}) on device '{st.device}'"
        if topo is None:
            raise UserError(
                f"{what} of topology '{prep.plan.topology}'; give that topology (--topology) "
                "so the run knows where its agent listens",
                Mark(plan_file, 1, 1),
            )
        label = (
            "this machine's topology (autodetected)"
            if topo.source == "local"
            else f"topology '{topo.name}' ({topo.source})"
        )
        raise UserError(
            f"{what}, which {label} lacks (it has "
            f"{', '.join(topo.ids)}); plan it again for this topology, or run with the topology "
            f"it was made for ('{prep.plan.topology}')",
            Mark(plan_file, 1, 1),
        )


@contextlib.contextmanager
def open_front(prep: Prepared) -> Iterator[RemoteFront | None]:
    """The agent front of the plan's leading DPU stage (started here when emulated), or None."""
    first = prep.plan.stages[0]
    with open_fronts(prep) as fronts:
        yield fronts.get(first.name)


@contextlib.contextmanager
def open_fronts(prep: Prepared) -> Iterator[dict[str, RemoteFront]]:
    """The agent front of each of the plan's DPU stages, by stage name (the agents started
    here when emulated): one connection and receiver each, sized by the plan's physical
    decisions. A DPU stage that the fast path feeds straight into a GPU stage lands its
    outputs on the GPU."""
    stages = prep.plan.stages
    dpus = [s for s in stages if s.kind == "dpu"]
    if not dpus:
        yield {}
        return
    for st in dpus:
        if prep.topology is None or st.device not in prep.topology.ids:
            raise DeviceError(
                f"stage '{st.name}' runs on '{st.device}': give the topology that says where "
                "its agent listens (--topology)"
            )
    from nicoffload.planner import physical
    from nicoffload.runtime.chain import fast_path
    from nicoffload.runtime.fronts import Wanted
    from nicoffload.runtime.fronts import open_fronts as _open

    plan = physical.complete(prep.pipeline, prep.plan, prep.topology)
    wanted = []
    for i, st in enumerate(stages):
        if st.kind != "dpu":
            continue
        gpu = None
        # DPU -> GPU on the fast path: land the outputs on the GPU
        if i == 0 and len(stages) > 1 and stages[1].kind == "gpu" and fast_path(plan):
            from nicoffload.devices.gpu import device as gpu_device

            gpu = gpu_device()
        decided = physical.of_stage(plan, st)  # the runtime's choices are the plan's
        device = prep.topology.device(st.device)
        wanted.append(Wanted(st, device, str(decided["scheme"]), int(decided["slots"]), gpu))
    with _open(prep.pipeline, plan, wanted, token_file=prep.token_file) as fronts:
        yield fronts
