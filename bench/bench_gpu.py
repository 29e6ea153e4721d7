"""GPU preprocessing benchmarks: ceilings, kernels, and ResNet-50 preprocessing side by side.

    PYTHONPATH=. python3 bench/bench_gpu.py --out OUT_DIR [--sections kernels,parity,pipeline,profile]
    PYTHONPATH=. python3 bench/bench_gpu.py --out OUT_DIR --sections e2e --images 4096

Everything in one process and one run, on the same JPEGs: copy and PCIe ceilings, the fused
kernel's bandwidth, nvJPEG decode alone, the usual torchvision recipe, and our GPU stage. Writes
OUT_DIR/bench_gpu.json (every number) and OUT_DIR/h200.json (the fitted GPU profile).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gpu_common import (  # bench/ is on sys.path when this runs as a script
    CUDA0,
    MEAN,
    RESNET,
    STD,
    cuda_ms,
    dataset,
    decode_only_fn,
    host_ms,
    timed,
)
from gpu_extras import (
    decode_points,
    e2e,
    landing,
    normalize_bounds,
    parity,
    profile,
    stage_phases,
)


def env() -> dict:
    import cupy
    import torch
    import torchvision

    smi = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.limit",
            "--format=csv,noheader",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(0),
        "nvidia_smi": smi,
        "cpu_cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchvision": torchvision.__version__,
        "cupy": cupy.__version__,
        "command": " ".join(sys.argv),
    }


# --- ceilings ---------------------------------------------------------------------------------


def ceilings(torch) -> dict:
    dev = torch.device("cuda")
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    d2d = cuda_ms(torch, lambda: b.copy_(a), reps=20)
    a = b = None  # free the 2 GiB
    m = 256 << 20
    host = torch.empty(m, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    pageable = torch.empty(m, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty(m, dtype=torch.uint8, device=dev)
    h2d = cuda_ms(torch, lambda: dst.copy_(host, non_blocking=True), reps=20)
    d2h = cuda_ms(torch, lambda: host.copy_(dst, non_blocking=True), reps=20)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(pageable)
    torch.cuda.synchronize()
    pg = (time.perf_counter() - t0) / 5 * 1e3
    small = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    sdst = torch.empty(4096, dtype=torch.uint8, device=dev)
    lat = cuda_ms(torch, lambda: sdst.copy_(small, non_blocking=True), reps=50)
    return {
        "d2d_copy_GBps": 2 * n / d2d / 1e6,
        "h2d_pinned_GBps": m / h2d / 1e6,
        "d2h_pinned_GBps": m / d2h / 1e6,
        "h2d_pageable_GBps": m / pg / 1e6,
        "h2d_4KiB_latency_ms": lat,
    }


def staged_h2d(torch, stage_cls, pipeline, gib_pinned: float) -> dict:
    """Host images staged through the pinned ring into the fused kernel, pipelined."""
    from nicoffload.planner.plan import StagePlan

    keep = {"norm"}
    plan = StagePlan("s0-gpu", "gpu0", "gpu", ("resize", "crop", "norm"))
    shapes = [(375, 500, 3)] * 128
    nbytes = 128 * 375 * 500 * 3
    with stage_cls(pipeline, plan, keep, slot_bytes=nbytes + (1 << 20)) as stage:
        copies = []

        def batches(k: int):
            for _ in range(k):
                hb = stage.host_batch(shapes)  # filled by a producer in a real run
                yield {"decode": hb}

        for _ in stage.stream(batches(4)):
            pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        k = 24
        for b in stage.stream(batches(k)):
            copies.append(b)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        per_step = stage.step_ms_per_item()
    # the copy alone, through the ring, for the DMA rate of staged slots
    from nicoffload.devices.gpu import PinnedRing, device

    gpu = device()
    s = gpu.new_stream()
    with PinnedRing(gpu, 3, nbytes) as ring:
        ev = []
        for _ in range(12):
            slot = ring.take(nbytes)
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record(s)
            ring.copy_in(slot, nbytes, s)
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record(s)
            ev.append((e0, e1))
        torch.cuda.synchronize()
        ms = statistics.median(a.elapsed_time(b) for a, b in ev[2:])
    return {
        "batch": "128 x 375x500x3 uint8 (72 MB) per batch",
        "pipelined_h2d_GBps_wall": k * nbytes / wall / 1e9,
        "staged_copy_GBps_events": nbytes / ms / 1e6,
        "pinned_ceiling_GBps": gib_pinned,
        "fused_ms_per_item": per_step,
    }


# --- kernels ----------------------------------------------------------------------------------


def kernels(torch, ceil: dict) -> dict:
    from nicoffload import ops
    from nicoffload.graph import load_pipeline

    pipeline = load_pipeline(RESNET)
    out = {}
    # normalize alone on a dense 256x224x224x3 batch (uint8 HWC -> fp16 CHW)
    norm_node = pipeline.node("norm")
    norm = ops.get_kernel("normalize", "gpu").build([norm_node], ())
    x = torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device="cuda")
    y = torch.empty((256, 3, 224, 224), dtype=torch.float16, device="cuda")
    ms = cuda_ms(torch, lambda: norm(x, out=y), reps=30, inner=20)
    moved = x.numel() + y.numel() * 2
    out["normalize_256x224x224x3_fp16_chw"] = {
        "single_launch_ms": cuda_ms(torch, lambda: norm(x, out=y), reps=30),
        "ms": ms,
        "GBps": moved / ms / 1e6,
        "fraction_of_d2d": moved / ms / 1e6 / ceil["d2d_copy_GBps"],
    }
    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1)
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1)

    def torch_norm():
        return ((x.permute(0, 3, 1, 2).float() / 255 - mean) / std).half()

    xb = torch.randint(0, 256, (1024, 224, 224, 3), dtype=torch.uint8, device="cuda")
    yb = torch.empty((1024, 3, 224, 224), dtype=torch.float16, device="cuda")
    ms = cuda_ms(torch, lambda: norm(xb, out=yb), reps=20, inner=10)
    moved = xb.numel() + yb.numel() * 2
    out["normalize_1024x224x224x3_fp16_chw"] = {
        "ms": ms,
        "GBps": moved / ms / 1e6,
        "fraction_of_d2d": moved / ms / 1e6 / ceil["d2d_copy_GBps"],
    }
    xb = yb = None
    out["normalize_torch_eager_ms"] = cuda_ms(torch, torch_norm, reps=20, inner=5)
    # the fused resize+crop+normalize on decoded-size batches (CHW planes, as nvJPEG writes)
    nodes = [pipeline.node(n) for n in ("resize", "crop", "norm")]
    fused = ops.get_kernel(("resize", "center_crop", "normalize"), "gpu").build(nodes, ())
    for n, (h, w) in ((256, (375, 500)), (64, (720, 1280)), (64, (1080, 1920))):
        planes = torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, device="cuda")
        views = [p.permute(1, 2, 0) for p in planes]
        dst = torch.empty((n, 3, 224, 224), dtype=torch.float16, device="cuda")
        ready = fused.prepare(views, out=dst)
        ms = cuda_ms(torch, lambda r=ready: fused.launch(r), reps=20, inner=10)
        prep = host_ms(lambda v=views, d=dst: fused.prepare(v, out=d))
        rh, rw = 256, int(256 * w / h)
        src_rows, src_cols = 224 * h / rh + 2 * max(h / rh, 1), 224 * w / rw + 2 * max(w / rw, 1)
        window = n * min(src_rows, h) * min(src_cols, w) * 3
        moved = window + dst.numel() * 2
        out[f"fused_{n}x{h}x{w}"] = {
            "ms": ms,
            "host_prepare_ms": prep,
            "ms_per_item": ms / n,
            "GBps_effective": moved / ms / 1e6,
            "fraction_of_d2d": moved / ms / 1e6 / ceil["d2d_copy_GBps"],
        }
    # the same on a dense 256x224x224x3 batch (resize 224 -> 256, crop 224)
    xx = torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device="cuda")
    ready = fused.prepare(xx, out=y)
    ms = cuda_ms(torch, lambda: fused.launch(ready), reps=20, inner=10)
    moved = xx.numel() + y.numel() * 2
    out["fused_256x224x224x3"] = {
        "ms": ms,
        "GBps": moved / ms / 1e6,
        "fraction_of_d2d": moved / ms / 1e6 / ceil["d2d_copy_GBps"],
    }
    return out


# --- pipeline side by side --------------------------------------------------------------------


def recipe_fn(torch, tvio):
    """The usual recipe: batched nvJPEG, then per image interpolate(antialias), crop; normalize."""
    import torch.nn.functional as F

    from nicoffload.ops.crop import crop_box
    from nicoffload.ops.resize import output_size

    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1)
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1)
    params = {"shorter": 256, "longer": None, "size": None}

    def run(batch: list[bytes]):
        imgs = tvio.decode_jpeg(
            [torch.frombuffer(b, dtype=torch.uint8) for b in batch], device=CUDA0
        )
        crops = torch.empty((len(imgs), 3, 224, 224), device="cuda")
        for i, img in enumerate(imgs):
            h, w = img.shape[1:]
            rh, rw = output_size(params, h, w)
            r = F.interpolate(
                img[None].float(),
                size=(rh, rw),
                mode="bilinear",
                antialias=True,
                align_corners=False,
            )
            top, left = crop_box(rh, rw, 224, 224)
            crops[i] = r[0, :, top : top + 224, left : left + 224]
        return ((crops / 255 - mean) / std).half()

    return run


def gil_probe(torch, batch: list[bytes]) -> float:
    """How fast a pure-Python loop runs while another thread decodes, against the same loop
    while another thread sleeps (1.0: decode_jpeg releases the GIL)."""
    import threading

    import torchvision.io as tvio

    ts = [torch.frombuffer(b, dtype=torch.uint8) for b in batch]

    def rate(work) -> float:
        th = threading.Thread(target=work)
        n, t0 = 0, time.perf_counter()
        th.start()
        while th.is_alive():
            n += 1
        return n / (time.perf_counter() - t0)

    sleeping = rate(lambda: time.sleep(0.3))
    decoding = rate(lambda: [tvio.decode_jpeg(ts, device=CUDA0) for _ in range(10)])
    return decoding / sleeping


def pipeline_side_by_side(
    torch, data: dict[str, list[bytes]], sizes, total: dict, rounds: int = 5
) -> dict:
    import torchvision.io as tvio

    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import StagePlan
    from nicoffload.runtime.gpu_stage import GpuStage

    pipeline = load_pipeline(RESNET)
    plan = StagePlan("s0-gpu", "gpu0", "gpu", ("decode", "resize", "crop", "norm"))
    stage = GpuStage(pipeline, plan, {"norm"}, workers=2)
    res: dict = {}

    def sequential(batches):  # one batch at a time on one thread: no overlap
        for x in batches:
            stage.process({"image": x}).wait()

    def ours(st):
        def run_all(batches):
            for b in st.stream({"image": x} for x in batches):
                b.wait()

        return run_all

    methods = {
        "nvjpeg_decode_only": decode_only_fn(torch, tvio, False),
        "recipe_torchvision": recipe_fn(torch, tvio),
        "ours_sequential": None,
        "ours": None,
    }
    for name, items in data.items():
        for bs in sizes:
            n_batches = max(4, total[name] // bs)
            batches = [
                [items[(k * bs + j) % len(items)] for j in range(bs)] for k in range(n_batches)
            ]
            row: dict = {}
            names, busy = list(methods), []
            for r in range(rounds):  # each in another order: drift and warm-up fall on all
                order = names[r % len(names) :] + names[: r % len(names)]
                order = order if r % 2 == 0 else order[::-1]
                for m in order:
                    if m.startswith("ours"):
                        run_all = sequential if m == "ours_sequential" else ours(stage)
                        run_all(batches[:2])  # warm
                        torch.cuda.synchronize()
                        c0, t0, d0 = time.process_time(), time.perf_counter(), stage.step_ms[0]
                        run_all(batches)
                        torch.cuda.synchronize()
                        wall = time.perf_counter() - t0
                        nimg = sum(len(b) for b in batches)
                        ips, cpu = nimg / wall, (time.process_time() - c0) * 1e3 / nimg
                        if m == "ours":  # the share of the wall time its nvJPEG calls took
                            busy.append((stage.step_ms[0] - d0) / 1e3 / wall)
                    else:
                        for b in batches[:2]:
                            methods[m](b)
                        ips, cpu = timed(torch, methods[m], batches)
                    row.setdefault(m, []).append(
                        {"images_per_s": ips, "host_cpu_ms_per_image": cpu}
                    )
            summary = {
                m: {
                    "images_per_s": statistics.median(r["images_per_s"] for r in runs),
                    "best": max(r["images_per_s"] for r in runs),
                    "runs": [round(r["images_per_s"], 1) for r in runs],
                    "host_cpu_ms_per_image": min(r["host_cpu_ms_per_image"] for r in runs),
                }
                for m, runs in row.items()
            }
            base = summary["nvjpeg_decode_only"]["images_per_s"]
            summary["ours_vs_decode_only"] = summary["ours"]["images_per_s"] / base
            # the same ratio round by round (both measured minutes apart at most), then its
            # median: robust to the host's drift between rounds, which moves both together
            paired = [
                o["images_per_s"] / d["images_per_s"]
                for o, d in zip(row["ours"], row["nvjpeg_decode_only"], strict=True)
            ]
            summary["ours_vs_decode_only_by_round"] = [round(p, 3) for p in paired]
            summary["ours_vs_decode_only_paired_median"] = statistics.median(paired)
            summary["ours_decode_busy_by_round"] = [round(b, 3) for b in busy]
            summary["ours_vs_recipe"] = (
                summary["ours"]["images_per_s"] / summary["recipe_torchvision"]["images_per_s"]
            )
            res[f"{name}_batch{bs}"] = summary
            print(
                f"{name:>10} bs={bs:<4} "
                + " ".join(f"{m}={summary[m]['images_per_s']:.0f}" for m in methods),
                flush=True,
            )
    res["gil_free_fraction_during_decode"] = gil_probe(torch, data["imagenet"][:256])
    res["host_phases_imagenet_64"] = stage_phases(torch, stage, data["imagenet"])
    res["ours_step_ms_per_item"] = stage.step_ms_per_item()
    res["decode_stats"] = vars(stage.steps[0].fn.stats)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--sections", default="ceilings,kernels,landing,parity,pipeline,profile")
    ap.add_argument("--sizes", default="64,128,256")
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the side-by-side pipeline")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from nicoffload.graph import load_pipeline
    from nicoffload.runtime.gpu_stage import GpuStage

    doc: dict = {"env": env()}
    print(json.dumps(doc["env"]), flush=True)

    def save():
        (out / "bench_gpu.json").write_text(json.dumps(doc, indent=2) + "\n")

    t = time.perf_counter()
    data = {"imagenet": dataset(512, 500, 375), "1080p": dataset(96, 1920, 1080)}
    extra = dataset(128, 1280, 720) if "profile" in secs else []
    doc["data"] = {
        k: {"images": len(v), "mean_bytes": float(np.mean([len(b) for b in v]))}
        for k, v in data.items()
    }
    print("data", doc["data"], f"{time.perf_counter() - t:.1f}s", flush=True)
    if "e2e" in secs:
        doc["e2e"] = e2e(out, args.images)
        (out / "e2e.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(doc["e2e"], indent=1)[-4000:])
        return
    if secs & {"session", "decoders"}:  # sections of their own (gpu_session.py)
        from gpu_session import decoders, session_side_by_side

        from nicoffload.samples import sample_images

        if "session" in secs:
            mixed = [b for _, b in sample_images(1024, seed=3)]
            doc["session"] = session_side_by_side(
                torch, data["imagenet"], args.images, args.rounds, mixed
            )
            print("session", json.dumps(doc["session"], indent=1), flush=True)
            save()
        if "decoders" in secs:
            sizes = [int(s) for s in args.sizes.split(",")]
            doc["decoders"] = decoders(torch, data["imagenet"], sizes)
            save()
        return
    ceil = ceilings(torch)
    doc["ceilings"] = ceil
    print("ceilings", ceil, flush=True)
    save()
    if "kernels" in secs:
        doc["kernels"] = kernels(torch, ceil)
        print("kernels", json.dumps(doc["kernels"], indent=1), flush=True)
        doc["staged_h2d"] = staged_h2d(
            torch, GpuStage, load_pipeline(RESNET), ceil["h2d_pinned_GBps"]
        )
        print("staged", doc["staged_h2d"], flush=True)
        save()
    if "bounds" in secs:  # not in the default sections: what bounds normalize (RESULTS_gpu.md)
        doc["normalize_bounds"] = normalize_bounds(torch, ceil)
        print("bounds", json.dumps(doc["normalize_bounds"], indent=1), flush=True)
        save()
    if "landing" in secs:
        doc["landing"] = landing(torch, ceil)
        print("landing", doc["landing"], flush=True)
        save()
    if "parity" in secs:
        doc["parity"] = parity(torch, data)
        print("parity", doc["parity"], flush=True)
        save()
    if "pipeline" in secs:
        sizes = [int(s) for s in args.sizes.split(",")]
        doc["pipeline"] = pipeline_side_by_side(
            torch,
            data,
            sizes,
            {"imagenet": args.images, "1080p": max(512, args.images // 8)},
            args.rounds,
        )
        save()
    if "profile" in secs and "kernels" in secs:
        dpts = decode_points(torch, [(data["imagenet"], 256), (extra, 128), (data["1080p"], 96)])
        fused, crop = [], 224 * 224
        for key, (h, w) in (
            ("fused_256x375x500", (375, 500)),
            ("fused_64x720x1280", (720, 1280)),
            ("fused_64x1080x1920", (1080, 1920)),
        ):
            rw = int(256 * w / h)
            work = (h * w + 256 * rw) * min(1.0, crop / (256 * rw)) + 2 * crop
            fused.append((float(work), doc["kernels"][key]["ms_per_item"]))
        npt = [
            (float(crop), doc["kernels"]["normalize_256x224x224x3_fp16_chw"]["ms"] / 256),
            (float(crop), doc["kernels"]["normalize_1024x224x224x3_fp16_chw"]["ms"] / 1024),
        ]
        prof = profile(doc["env"], ceil, dpts, fused, npt)
        (out / "h200.json").write_text(json.dumps(prof, indent=2) + "\n")
        doc["profile_points"] = {"decode": dpts, "fused": fused, "normalize": npt}
        save()
    print("done", flush=True)


if __name__ == "__main__":
    main()
