"""What a call measured, per stage and per transfer: the `stages`, `transfers` and `failover`
parts of `run --json`, predicted beside measured."""

from __future__ import annotations

from typing import Any

from nicoffload.planner.plan import StagePlan
from nicoffload.runner import RunStats
from nicoffload.runtime.executor import Executor
from nicoffload.runtime.remote import RemoteFront


def _stage_doc(
    stage: StagePlan,
    measured: float,
    steps: dict[str, float] | None,
    wall: float | None = None,
    items: int | None = None,
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
    if items is not None:  # the call's items its first step ran (taken back ones on the host)
        doc["items"] = items
    if steps is not None:
        doc["steps"] = {k: round(v, 4) for k, v in steps.items()}
    return doc


def finish_stats(stats: RunStats, ex: Executor, front: RemoteFront | None) -> None:
    """Fill a call's per-stage and per-transfer figures (`run --json` "stages", "transfers",
    "failover") from what the executor, the agent and the transfer measured."""
    if front is not None:
        remote = front.remote_stats()
        steps = {k: float(v["cpu_ms"]) for k, v in remote.get("steps", {}).items()}
        stats.stages[front.stage.name] = _stage_doc(
            front.stage,
            float(remote.get("cpu_ms_per_item", 0.0)),
            steps or None,
            float(remote.get("wall_ms_per_item", 0.0)),
            remote.get("items"),
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
        stats.assisted = getattr(ex, "assisted", 0)  # the general path assists nothing
        if ex.failed_over:
            stats.failover = (
                f"{ex.failed_over} ({ex.taken_back} items ran stage '{front.stage.name}' on the "
                "host instead)"
            )
    for plan, times in ex.step_times():
        cpu = {k: t.cpu_ms for k, t in times.items()}
        wall = sum(t.wall_ms for t in times.values())
        first = next(iter(times.values()), None)
        stats.stages[plan.name] = _stage_doc(
            plan, sum(cpu.values()), cpu, wall, first.calls if first else None
        )
    if ex.gpu is not None:
        mine = ex.gpu.step_ms_per_item()
        stats.stages[ex.gpu.plan.name] = _stage_doc(ex.gpu.plan, float(sum(mine.values())), mine)
