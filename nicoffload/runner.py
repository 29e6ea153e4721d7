"""The public way to run a pipeline from Python: `nicoffload.run(pipeline, items)`.

It plans (or takes a plan), builds the executor, streams the items, and returns the outputs as
numpy arrays with per-item status and the run's measurements (`RunStats`, the `run --json` shape).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.errors import DeviceError, Mark, UserError
from nicoffload.graph import Pipeline, load_pipeline
from nicoffload.inputs import values_items
from nicoffload.planner.plan import Plan, StagePlan
from nicoffload.runtime.executor import Batch, Executor, ItemFailure
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
    batches: int = 0

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
            "host_cpu_ms_per_item": round(self.host_cpu_ms_per_item, 4),
            "wall_s": round(self.wall_s, 4),
            "batches": self.batches,
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
) -> Prepared:
    """The pipeline and the plan to run it with: the given plan, else one planned now.

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

        # Only plans of a shape the executor runs (the planner's note says what the best plan
        # overall would have been, when it is of another shape).
        topology = topology if topology is not None else local_topology()
        plan = plan_for(pipeline, topology, runnable=True)
    elif not isinstance(plan, Plan):
        source = str(plan)
        plan = Plan.load(plan)
        plan.check_matches(pipeline, source)
    else:
        source = "<plan>"
    if topology is None and plan.topology == "local":
        topology = local_topology()
    prep = Prepared(pipeline, plan, topology, token_file)
    if source is not None:
        check_plan_devices(prep, source)
    return prep


def check_plan_devices(prep: Prepared, plan_file: str) -> None:
    """A plan that places a stage on a device the topology lacks is the user's mistake: the
    plan was made for another topology."""
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
    """The agent serving the plan's leading DPU stage (started here when emulated), or None."""
    first = prep.plan.stages[0]
    if first.kind != "dpu":
        yield None
        return
    if prep.topology is None or first.device not in prep.topology.ids:
        raise DeviceError(
            f"stage '{first.name}' runs on '{first.device}': give the topology that says where "
            "its agent listens (--topology)"
        )
    device = prep.topology.device(first.device)
    from nicoffload.runtime.remote import open_front as _open

    gpu = None
    stages = prep.plan.stages
    if len(stages) > 1 and stages[1].kind == "gpu":  # DPU -> GPU: land the outputs on the GPU
        from nicoffload.devices.gpu import device as gpu_device

        gpu = gpu_device()
    with _open(
        prep.pipeline,
        prep.plan,
        first,
        device,
        transport=_transport(prep, first),
        token_file=prep.token_file,
        gpu=gpu,
    ) as front:
        yield front


def _transport(prep: Prepared, first: StagePlan) -> str:
    """The scheme the DPU stage forwards over: the plan's transfer, else the topology's link."""
    out = next((t for t in prep.plan.transfers if t.src_stage == first.name), None)
    link = out.transport.split("+")[0] if out is not None else "tcp"
    if link == "inproc" and out is not None and prep.topology is not None:
        dst = next(s.device for s in prep.plan.stages if s.name == out.dst_stage)
        ends = {first.device, dst}
        link = next((ln.transport for ln in prep.topology.links if {ln.a, ln.b} == ends), "tcp")
    return "rdma" if link.startswith("rdma") else "shm" if link == "shm" else "tcp"


def _stage_doc(
    stage: StagePlan,
    measured: float,
    steps: dict[str, float] | None,
    wall: float | None = None,
) -> dict[str, Any]:
    """A stage of `run --json`. On CPU and DPU devices `ms_per_item` is the CPU time its kernels
    took per item in the worker that ran them (core-ms, the unit the planner predicts in) and
    `wall_ms_per_item` the same calls by the wall clock; GPU stages report their own time."""
    predicted = stage.predicted_ms_per_item
    doc: dict[str, Any] = {
        "device": stage.device,
        "nodes": list(stage.nodes),
        "ms_per_item": round(measured, 4),
        "predicted_ms_per_item": None if predicted is None else round(predicted, 4),
        "error_pct": None
        if predicted is None or measured == 0
        else round(100 * (predicted - measured) / measured, 1),
    }
    if wall is not None:
        doc["wall_ms_per_item"] = round(wall, 4)
    if steps is not None:
        doc["steps"] = {k: round(v, 4) for k, v in steps.items()}
    return doc


def _finish_stats(stats: RunStats, ex: Executor, front: RemoteFront | None) -> None:
    if front is not None:
        remote = front.remote_stats()
        steps = {k: float(v["cpu_ms"]) for k, v in remote.get("steps", {}).items()}
        stats.stages[front.stage.name] = _stage_doc(
            front.stage,
            float(remote.get("cpu_ms_per_item", 0.0)),
            steps or None,
            float(remote.get("wall_ms_per_item", 0.0)),
        )
        t = front.transfer
        for tr in ex.plan.transfers:
            if tr.src_stage == front.stage.name:
                stats.transfers[f"{tr.src_stage}->{tr.dst_stage}"] = {
                    "tensor": tr.tensor,
                    "transport": tr.transport,
                    "batches": t.batches,
                    "bytes_per_item": round(t.bytes / t.items) if t.items else 0,
                    # what the plan assumed (the pipeline's `typical` input): a measured size far
                    # from it explains a stage's time far from its prediction
                    "predicted_bytes_per_item": tr.bytes_per_item,
                    "ms_per_batch": round(t.flight_ns / t.timed / 1e6, 4) if t.timed else None,
                    "predicted_ms_per_item": tr.predicted_ms_per_item,
                }
                if front.landing is not None:  # the outputs went straight to the GPU stage
                    stats.transfers[f"{tr.src_stage}->{tr.dst_stage}"]["gpu_landing"] = {
                        "destination": front.destination.kind,
                        "reason": front.destination.reason,
                        "batches": front.landing.copies,
                        "bytes": front.landing.bytes,
                    }
        if ex.failed_over:
            stats.failover = (
                f"{ex.failed_over} ({ex.taken_back} items ran stage '{front.stage.name}' on the "
                "host instead)"
            )
    for plan, times in ex.step_times():
        cpu = {k: t.cpu_ms for k, t in times.items()}
        wall = sum(t.wall_ms for t in times.values())
        stats.stages[plan.name] = _stage_doc(plan, sum(cpu.values()), cpu, wall)
    if ex.gpu is not None:
        mine = ex.gpu.step_ms_per_item()
        stats.stages[ex.gpu.plan.name] = _stage_doc(ex.gpu.plan, float(sum(mine.values())), mine)


def stream(
    prep: Prepared,
    items: Iterable[tuple[str, Any]],
    stats: RunStats,
    *,
    workers: int | None = None,
) -> Iterator[Batch]:
    """Run and yield batches; `stats` is filled as the run goes and complete at the end."""
    if workers is None and prep.topology is not None and "cpu" in prep.topology.ids:
        # the host's share of the cores: an emulated DPU's agent is pinned to the others
        workers = prep.topology.device("cpu").cores
    with (
        open_front(prep) as front,
        Executor(prep.pipeline, prep.plan, workers=workers, front=front) as ex,
    ):
        stats.placement = dict(prep.plan.placement)
        cpu0, t0 = time.process_time(), time.perf_counter()
        reasons: Counter[str] = Counter()
        for batch in ex.stream(items):
            stats.items += len(batch)
            stats.batches += 1
            stats.errors += len(batch.failures)
            reasons.update(f.reason for f in batch.failures)
            for f in batch.failures:
                stats.error_examples.setdefault(f.reason, f"{f.name}: {f.detail}")
            stats.latencies_s.extend(batch.latencies_s.tolist())
            stats.wall_s = time.perf_counter() - t0
            yield batch
        stats.wall_s = time.perf_counter() - t0
        stats.host_cpu_s = time.process_time() - cpu0
        stats.errors_by_reason = dict(reasons)
        _finish_stats(stats, ex, front)


def run(
    pipeline: Pipeline | str | Path,
    inputs: Iterable[Any],
    *,
    plan: Plan | str | Path | None = None,
    topology: str | Path | None = None,
    token_file: str | Path | None = None,
    workers: int | None = None,
) -> RunResult:
    """Run a pipeline over `inputs` and return every output as numpy arrays in item order.

    `inputs`: bare values (bytes, str, Path) for a one-input pipeline, mappings of input name to
    value, or `(name, mapping)` pairs. Per-item failures are reported in `failures`, not raised.
    """
    prep = prepare(pipeline, plan, topology, token_file)
    pipeline = prep.pipeline
    stats = RunStats()
    names: list[str] = []
    parts: dict[str, list[Any]] = {k: [] for k in pipeline.outputs}
    on_gpu: dict[str, list[Any]] = {}
    oks, failures = [], []
    for batch in stream(prep, values_items(pipeline, inputs), stats, workers=workers):
        names.extend(batch.names)
        oks.append(batch.ok.copy())
        failures.extend(batch.failures)
        for k, v in batch.outputs.items():
            if hasattr(v, "is_cuda"):  # a GPU stage's tensor (fresh per batch): kept for torch()
                on_gpu.setdefault(k, []).append(v)
        for k, v in batch.numpy().outputs.items():
            parts[k].append(v.copy() if isinstance(v, np.ndarray) else list(v))
    specs = pipeline.output_specs()
    outputs: dict[str, Any] = {}
    for k, chunks in parts.items():
        if specs[k].static:
            outputs[k] = (
                np.concatenate(chunks) if chunks else np.zeros((0, *specs[k].shape), specs[k].dtype)
            )
        else:
            outputs[k] = [x for c in chunks for x in c]
    ok = np.concatenate(oks) if oks else np.zeros(0, bool)
    gpu_out: dict[str, Any] = {}
    if on_gpu:
        import torch

        gpu_out = {k: torch.cat(v) for k, v in on_gpu.items()}
    return RunResult(names, outputs, ok, failures, stats, gpu_out)
