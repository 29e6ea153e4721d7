"""Measuring the host process's serial (GIL-held) time per item of a stage, as the runtime runs
it, on its fast and its general path (`measure_host_serial`), for a profile's serial terms
(`nicoffload profile`; `profiling.with_gpu_serial` for a GPU stage's host side)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

# The batch sizes the host's serial time is measured at (its per-batch part is their difference),
# how many calls of each (the median is kept), and the items of each call.
SERIAL_BATCHES = (64, 8)
SERIAL_ROUNDS, QUICK_SERIAL_ROUNDS = 5, 3
SERIAL_ITEMS, QUICK_SERIAL_ITEMS = 4096, 2048


def _serial_cpu_s(pipeline, items: list, workers: int, general: bool, device: str) -> float:
    """Process CPU s of one call of `items` through `pipeline` all on `device` (the host, or
    a GPU), on the runtime's fast path (a Session's executor) or its general path
    (`runtime.chain`, which runs host stages after a GPU stage), warmed first, every batch
    read in place."""
    from nicoffload.planner.plan import single_device_plan
    from nicoffload.runner import prepare
    from nicoffload.runtime.chain import Chain
    from nicoffload.session import Session

    plan = single_device_plan(pipeline, device)
    if general:  # the chain takes (name, values) items
        runner: Any = Chain(pipeline, plan, workers=workers)
        feed: list = [(str(i), {"image": b}) for i, b in enumerate(items)]
    else:
        runner, feed = Session(prepare(pipeline, plan, None), workers=workers), items
    with runner:
        for _ in runner.stream(feed[:256]):
            pass
        c0 = time.process_time()
        for _ in runner.stream(feed):
            pass
        return time.process_time() - c0


def fit_serial(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(us per item, us per batch) of `a + b / batch size` through (batch size, us per item)
    points, by least squares, neither below zero."""
    x = np.array([1.0 / p[0] for p in points])
    y = np.array([p[1] for p in points])
    if np.ptp(x) == 0:
        return max(0.0, float(y.mean())), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return max(0.0, float(y.mean())), 0.0
    if a < 0:
        return 0.0, float((x @ y) / (x @ x))
    return float(a), float(b)


def measure_host_serial(
    device: str = "cpu", *, quick: bool = False, workers: int | None = None
) -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
    """The host process's serial time per item of a stage on `device` (a host stage; or a GPU
    stage, `gpu0`: its batches are fed, decoded and handed on by Python in the same process),
    in us, per path of the runtime ("fast": `runtime.executor`, "general": `runtime.chain`):
    `a` per item and `b` per batch (`a + b / batch size`); and the points they came from.

    The host runs its stages in threads of one Python process: the kernels give the GIL back,
    the Python around them (per row and per batch: values and destinations, the executor's
    hand-offs, stamps, settling) does not, so only one thread at a time does it. Measured as
    the runtime runs it: the ResNet recipe's kernels over tiny JPEGs to a tiny output
    (`data/agent_probe.yaml`: the kernels' native work is a few us, their Python wrappers
    are in), all on `device`, on `workers` threads (the host's share of the cores, as a run
    of the local topology uses), through both the fast path and the general path, at two
    batch sizes; the process's CPU over a call, per item, is then nearly all GIL-held (the
    rest is the kernels' few us of native work on 32x32 images: an upper bound by that
    much)."""
    import io

    from PIL import Image

    from nicoffload.graph import load_pipeline

    if workers is None:
        from nicoffload.topology import local_topology

        workers = local_topology(gpu=False).device("cpu").cores
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(buf, "JPEG")
    base = load_pipeline(Path(__file__).parent / "data" / "agent_probe.yaml")
    items = [buf.getvalue()] * (QUICK_SERIAL_ITEMS if quick else SERIAL_ITEMS)
    rounds = QUICK_SERIAL_ROUNDS if quick else SERIAL_ROUNDS
    fits, points = {}, {}
    for path, general in (("fast", False), ("general", True)):
        pts = []
        for size in SERIAL_BATCHES:
            pipeline = replace(base, batch_max_size=size)
            cpu = [_serial_cpu_s(pipeline, items, workers, general, device) for _ in range(rounds)]
            pts.append((size, float(np.median(cpu)) * 1e6 / len(items)))
        fits[path], points[path] = fit_serial(pts), [[b, round(us, 2)] for b, us in pts]
    return fits, {"workers": workers, "us_per_item_at_batch": points}


def serial_terms(fits: dict[str, tuple[float, float]]) -> dict[str, float]:
    """measure_host_serial's fits as Profile fields."""
    (a, b), (ga, gb) = fits["fast"], fits["general"]
    return {
        "serial_us_per_item": a,
        "serial_us_per_batch": b,
        "serial_general_us_per_item": ga,
        "serial_general_us_per_batch": gb,
    }


def serial_method(what: str, device: str, info: dict[str, Any]) -> str:
    return (
        f"host serial (GIL-held) time per item of {what}: process CPU of the runtime over tiny "
        f"JPEGs all on {device} on {info['workers']} worker threads, on the fast and the "
        f"general path, at batch sizes {', '.join(map(str, SERIAL_BATCHES))}, us/item "
        f"{info['us_per_item_at_batch']}, fit a + b / batch size per path"
    )
