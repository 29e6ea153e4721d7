"""Session.run against Session.stream on the all-GPU plan, and the ways a GPU output can come
down to the host, side by side on one open session (issue #18: `run` measured 3,230 items/s
where `stream` gave 14,917 on the H200). Needs a CUDA GPU.

    python bench/bench_session_run.py [--items 1024] [--rounds 3] [--out FILE.json]

Rows: `stream` (outputs left on the GPU, read in place); `run` with the caller's previous
result alive (as a loop that keeps its last result does) and dropped; the old `run` path (every
batch kept on the GPU, concatenated, the whole call pinned at the end) beside the same two
lifetimes; per-batch pageable `.cpu()`; and the pinning of a whole call's output alone."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_prediction import typical_jpegs

import nicoffload
from nicoffload.planner import plan_placement
from nicoffload.topology import local_topology


def timed(fn: Callable[[], Any], items: int, rounds: int) -> dict[str, float]:
    fn()  # warm
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = rounds * items
    return {"items_per_s": round(n / wall), "host_cpu_ms_per_item": round(cpu * 1e3 / n, 4)}


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pipeline = nicoffload.load_pipeline("pipelines/resnet50.yaml")
    topology = local_topology()
    plan = plan_placement(pipeline, {n.name: "gpu0" for n in pipeline.nodes}, topology)
    images = typical_jpegs(args.items, 375, 500)
    rows: dict[str, dict[str, float]] = {}
    with nicoffload.open(pipeline, plan, topology) as s:
        kept: list[Any] = []

        def keeping(fn: Callable[[], Any]) -> Callable[[], None]:
            def call() -> None:
                kept[:] = [fn()]  # the previous result is alive while the next call runs

            return call

        def stream() -> None:
            for _ in s.stream(images):
                pass

        def old_run() -> Any:
            g = torch.cat([b.outputs["pixels"] for b in s.stream(images)])
            host = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
            host.copy_(g)
            return host.numpy()

        cases = {
            "stream": stream,
            "run, previous result alive": keeping(lambda: s.run(images)),
            "run, result dropped": lambda: s.run(images),
            "old run path, previous result alive": keeping(old_run),
            "old run path, result dropped": old_run,
            "stream + per-batch .cpu() (pageable)": lambda: [
                b.outputs["pixels"].cpu() for b in s.stream(images)
            ],
        }
        for name, fn in cases.items():
            rows[name] = timed(fn, len(images), args.rounds)
            kept.clear()
            print(f"{name:40s} {rows[name]}", flush=True)
    half = args.items * 3 * 224 * 224  # float16 elements of one call's output
    held = []
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(3):
        held.append(torch.empty(half, dtype=torch.float16, pin_memory=True))
    pin = {"ms_each": (time.perf_counter() - w0) / 3 * 1e3, "cpu_ms_each": 0.0}
    pin["cpu_ms_each"] = (time.process_time() - c0) / 3 * 1e3
    rows["pin one call's output (torch)"] = {k: round(v, 1) for k, v in pin.items()}
    print(rows["pin one call's output (torch)"])
    doc = {
        "machine": f"{platform.node()} ({platform.processor() or '?'})",
        "gpu": torch.cuda.get_device_name(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
