"""The public way to run a pipeline from Python: `nicoffload.run(pipeline, items)`.

It plans (or takes a plan), builds the executor, streams the items, and returns the outputs as
numpy arrays with per-item status and the run's measurements (`RunStats`, the `run --json` shape).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.graph import Pipeline, load_pipeline
from nicoffload.inputs import values_items
from nicoffload.planner.plan import Plan
from nicoffload.runtime.executor import Batch, Executor, ItemFailure


@dataclass
class RunStats:
    """What a run measured. `to_json()` is the document `nicoffload run --json` prints."""

    items: int = 0
    errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    host_cpu_s: float = 0.0
    placement: dict[str, str] = field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
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
            "throughput_per_s": round(self.throughput_per_s, 2),
            "latency_ms": {
                "p50": round(self.latency_ms(50), 3),
                "p99": round(self.latency_ms(99), 3),
            },
            "placement": self.placement,
            "stages": self.stages,
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

    def torch(self) -> dict[str, Any]:
        """The static outputs as torch tensors sharing memory with the arrays (DLPack)."""
        try:
            import torch
        except ImportError as exc:
            from nicoffload.errors import MissingDependency

            raise MissingDependency("torch", "gpu", "RunResult.torch()") from exc
        return {
            k: torch.from_dlpack(v) for k, v in self.outputs.items() if isinstance(v, np.ndarray)
        }


def prepare(
    pipeline: Pipeline | str | Path,
    plan: Plan | str | Path | None = None,
    topology: str | Path | None = None,
) -> tuple[Pipeline, Plan]:
    """The pipeline and the plan to run it with: the given plan, else one planned now.

    Without a topology the local machine's host CPU is planned for: the executor in this
    version runs host stages only (split DPU/GPU execution joins it with the agent runtime).
    """
    if not isinstance(pipeline, Pipeline):
        pipeline = load_pipeline(pipeline)
    if plan is None:
        from nicoffload.planner import plan_for
        from nicoffload.topology import local_topology

        topo = topology if topology is not None else local_topology(emulate_dpu=False, gpu=False)
        plan = plan_for(pipeline, topo)
    elif not isinstance(plan, Plan):
        source = str(plan)
        plan = Plan.load(plan)
        plan.check_matches(pipeline, source)
    return pipeline, plan


def stream(
    pipeline: Pipeline,
    plan: Plan,
    items: Iterable[tuple[str, Any]],
    stats: RunStats,
    *,
    workers: int | None = None,
    on_batch: Callable[[Batch], None] | None = None,
) -> Iterator[Batch]:
    """Run and yield batches; `stats` is filled as the run goes and complete at the end."""
    with Executor(pipeline, plan, workers=workers) as ex:
        stats.placement = dict(plan.placement)
        cpu0, t0 = time.process_time(), time.perf_counter()
        reasons: Counter[str] = Counter()
        for batch in ex.stream(items):
            stats.items += len(batch)
            stats.batches += 1
            stats.errors += len(batch.failures)
            reasons.update(f.reason for f in batch.failures)
            stats.latencies_s.extend(batch.latencies_s.tolist())
            stats.wall_s = time.perf_counter() - t0
            if on_batch:
                on_batch(batch)
            yield batch
        stats.wall_s = time.perf_counter() - t0
        stats.host_cpu_s = time.process_time() - cpu0
        stats.errors_by_reason = dict(reasons)
        steps = ex.step_ms_per_item()
        for stage in ex.stages:
            names = [st.name for st in stage.steps]
            measured = float(sum(steps[n] for n in names))
            predicted = stage.plan.predicted_ms_per_item
            stats.stages[stage.plan.name] = {
                "device": stage.plan.device,
                "nodes": list(stage.plan.nodes),
                "ms_per_item": round(measured, 4),
                "predicted_ms_per_item": None if predicted is None else round(predicted, 4),
                "error_pct": None
                if predicted is None or measured == 0
                else round(100 * (predicted - measured) / measured, 1),
                "steps": {n: round(float(steps[n]), 4) for n in names},
            }


def run(
    pipeline: Pipeline | str | Path,
    inputs: Iterable[Any],
    *,
    plan: Plan | str | Path | None = None,
    topology: str | Path | None = None,
    workers: int | None = None,
) -> RunResult:
    """Run a pipeline over `inputs` and return every output as numpy arrays in item order.

    `inputs`: bare values (bytes, str, Path) for a one-input pipeline, mappings of input name to
    value, or `(name, mapping)` pairs. Per-item failures are reported in `failures`, not raised.
    """
    pipeline, plan = prepare(pipeline, plan, topology)
    stats = RunStats()
    names: list[str] = []
    parts: dict[str, list[Any]] = {k: [] for k in pipeline.outputs}
    oks, failures = [], []
    for batch in stream(pipeline, plan, values_items(pipeline, inputs), stats, workers=workers):
        names.extend(batch.names)
        oks.append(batch.ok.copy())
        failures.extend(batch.failures)
        for k, v in batch.outputs.items():
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
    return RunResult(names, outputs, ok, failures, stats)
