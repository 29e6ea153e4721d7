"""Is the planner right about this machine? Predicted vs measured ms/item for each stage.

Plans `pipelines/resnet50.yaml` for this machine's local topology (host CPU + an emulated DPU:
a local agent pinned to a core share), and for the host alone, after `nicoffload profile`; runs
each plan on ImageNet-size JPEGs (the pipeline's `typical` size) at each JPEG quality of
`--qualities` (the decoder's time grows with a file's bytes: each corpus is priced at its own
mean bytes and size, as `plan --input` and `run` price a folder) and compares each stage's predicted ms/item with the measured one: the CPU time its
kernels took per item (`run --json`'s `ms_per_item`, core-ms like the prediction), with the wall
time of the same calls beside it. The load average before and after each run is recorded.

    python bench/bench_prediction.py [--items 400] [--qualities 50,90,97] [--progressive 0,0.5]
                                     [--json] [--record bench/RESULTS_prediction.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import simplejpeg
from PIL import Image

import nicoffload
from nicoffload.graph import with_typical
from nicoffload.planner import plan_for
from nicoffload.profiles import load_profile, measured_path
from nicoffload.runner import RunStats, prepare
from nicoffload.samples import sample_image
from nicoffload.session import stream
from nicoffload.sizes import typical_of
from nicoffload.topology import local_topology

PIPELINE = "pipelines/resnet50.yaml"
TARGET_PCT = 25.0


def typical_jpegs(
    n: int, h: int, w: int, quality: int = 90, progressive: float = 0.0
) -> list[bytes]:
    """Sample photos cropped to the pipeline's typical aspect and size (seeds unlike the
    profile's); a `progressive` share of them (spread evenly) encoded as progressive JPEGs."""
    out = []
    for i in range(n):
        _, data = sample_image(1000 + i, seed=11)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        scale = max(h / img.height, w / img.width)
        img = img.resize(
            (round(img.width * scale + 0.5), round(img.height * scale + 0.5)), Image.BILINEAR
        )
        top, left = (img.height - h) // 2, (img.width - w) // 2
        arr = np.ascontiguousarray(np.asarray(img)[top : top + h, left : left + w])
        if int((i + 1) * progressive) > int(i * progressive):  # simplejpeg: baseline only
            buf = io.BytesIO()
            Image.fromarray(arr).save(
                buf, "JPEG", quality=quality, subsampling="4:2:0", progressive=True
            )
            out.append(buf.getvalue())
        else:
            out.append(simplejpeg.encode_jpeg(arr, quality=quality, colorsubsampling="420"))
    return out


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def measure(pipeline, topology, images: list[bytes]) -> tuple[dict, RunStats]:
    plan = plan_for(pipeline, topology)
    prep = prepare(pipeline, plan, topology)
    stats = RunStats()
    items = [(str(i), {"image": b}) for i, b in enumerate(images)]
    for _ in stream(prep, items, stats):
        pass
    return plan.to_json(), stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--record", type=Path, default=None)
    ap.add_argument(
        "--qualities", default="90", help="JPEG qualities of the corpora, e.g. 50,90,97"
    )
    ap.add_argument(
        "--progressive",
        default="0",
        help="shares of progressive JPEGs in the corpora, e.g. 0,0.5 (one corpus per quality and share)",
    )
    args = ap.parse_args()
    if not measured_path("cpu").exists():
        subprocess.run([sys.executable, "-m", "nicoffload", "profile"], check=True)
    base = nicoffload.load_pipeline(PIPELINE)
    spec = base.inputs["image"]
    rows, runs = [], {}
    shares = [float(p) for p in args.progressive.split(",")]
    for quality in (int(q) for q in args.qualities.split(",")):
        for share in shares:
            h, w = spec.hint("height"), spec.hint("width")
            images = typical_jpegs(args.items, h, w, quality, share)
            typical = typical_of(base, [(str(i), {"image": b}) for i, b in enumerate(images)])
            pipeline = with_typical(base, typical)
            kb = typical["image"]["bytes"] / 1e3
            prog = f", {share:.0%} progressive" if share else ""
            corpus(pipeline, images, f"q{quality}, {kb:.0f} KB{prog}", rows, runs)
    emit(args, rows, runs)


def corpus(pipeline, images: list[bytes], what: str, rows: list, runs: dict) -> None:
    for where, topo in (
        ("local (host + emulated DPU)", local_topology(gpu=False)),
        ("host only", local_topology(emulate_dpu=False, gpu=False)),
    ):
        label = f"{where}, {what}"
        nicoffload.run(
            pipeline, images[:32], plan=plan_for(pipeline, topo), topology=topo
        )  # warm-up
        before = loadavg()
        plan, stats = measure(pipeline, topo, images)
        load = f"{before} -> {loadavg()}"
        doc = stats.to_json()
        runs[label] = {"plan_placement": plan["placement"], "run": doc, "loadavg_1min": load}
        for name, st in doc["stages"].items():
            pred, wall = st["predicted_ms_per_item"], st.get("wall_ms_per_item")
            rows.append(
                (
                    label,
                    name,
                    st["device"],
                    "+".join(st["nodes"]),
                    pred,
                    st["ms_per_item"],
                    st["error_pct"],
                    wall,
                    None if not wall else round(100 * (pred - wall) / wall, 1),
                    load,
                )
            )


def emit(args, rows: list, runs: dict) -> None:
    if args.json:
        print(json.dumps({"rows": rows, "runs": runs}, indent=2))
        return
    lines = [
        "| topology | stage | device | nodes | predicted ms/item | measured (kernel CPU) ms/item "
        "| error | within 25% | kernel wall ms/item | error vs wall | load 1 min |",
        "|---|---|---|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for label, name, dev, nodes, pred, meas, err, wall, werr, load in rows:
        ok = "yes" if err is not None and abs(err) <= TARGET_PCT else "**no**"
        lines.append(
            f"| {label} | {name} | {dev} | {nodes} | {pred:.3f} | {meas:.3f} | {err:+.1f}% | {ok} "
            f"| {wall:.3f} | {werr:+.1f}% | {load} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.record:
        prof = load_profile(measured_path("cpu"))
        head = (
            f"## Planner prediction vs measurement (`bench/bench_prediction.py`)\n\n"
            f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC\n"
            f"- machine: {platform.processor() or platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, Python {platform.python_version()}\n"
            f"- command: `python bench/bench_prediction.py --items {args.items} --qualities {args.qualities} --progressive {args.progressive} --record {args.record}`\n"
            f"- items: {args.items} JPEGs of the pipeline's typical size per quality; profile: {measured_path('cpu')} "
            f"({prof.date}; {prof.method})\n\n"
        )
        args.record.write_text(head + table + "\n")


if __name__ == "__main__":
    main()
