"""The GPU benchmark's parity check, profile fit, decode points, nvImageCodec comparison and
the end-to-end plan + run (sections of bench_gpu.py)."""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gpu_common import RESNET, cuda_ms, decode_only_fn, timed


def parity(torch, data: dict[str, list[bytes]]) -> dict:
    from PIL import Image

    from nicoffload import ops
    from nicoffload.graph import load_pipeline

    pipeline = load_pipeline(RESNET)
    dec = ops.get_kernel("decode_image", "gpu").build([pipeline.node("decode")], ())
    nodes = [pipeline.node(n) for n in ("resize", "crop")]
    rc = ops.get_kernel(("resize", "center_crop"), "gpu").build(nodes, ())
    out = {}
    for name, items in data.items():
        items = items[:48]
        got = dec(items)
        diffs, exact = [], 0
        crops = rc(got).cpu().numpy()
        for data_, t, c in zip(items, got, crops, strict=True):
            with Image.open(io.BytesIO(data_)) as im:
                want = np.asarray(im.convert("RGB"))
            g = t.cpu().numpy()
            diffs.append(float(np.abs(g.astype(np.int16) - want).mean()))
            h, w = g.shape[:2]
            rh, rw = (256, int(256 * w / h)) if h <= w else (int(256 * h / w), 256)
            r = np.asarray(
                Image.fromarray(np.ascontiguousarray(g)).resize((rw, rh), Image.BILINEAR)
            )
            top, left = round((rh - 224) / 2), round((rw - 224) / 2)
            exact += bool((r[top : top + 224, left : left + 224] == c).all())
        out[name] = {
            "decode_mean_abs_diff_vs_pillow": {
                "min": min(diffs),
                "median": statistics.median(diffs),
                "max": max(diffs),
            },
            "resize_crop_bit_exact_with_pillow": f"{exact}/{len(items)}",
        }
    return out


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    if len(points) == 1:
        return 0.0, float(y[0] / x[0])
    b, a = np.polyfit(x, y, 1)
    if a < 0:  # keep the intercept physical
        a, b = 0.0, float((x * y).sum() / (x * x).sum())
    return float(a), float(b)


def profile(ev: dict, ceil: dict, decode_pts, fused_pts, norm_pts) -> dict:
    """The GPU profile (nicoffload/data/profiles/h200.json is one) from this run's points."""
    kernels = {}
    for key, pts in (
        ("decode_image", decode_pts),
        ("resize+center_crop+normalize", fused_pts),
        ("normalize", norm_pts),
    ):
        a, b = (
            fit(pts)
            if len({w for w, _ in pts}) > 1
            else (0.0, statistics.mean(t / w for w, t in pts))
        )
        kernels[key] = {"a_ms": a, "b_ms": b, "unit": "pixels", "points": [[w, t] for w, t in pts]}
    fused = kernels["resize+center_crop+normalize"]
    for key in ("resize", "center_crop", "resize+center_crop", "center_crop+normalize"):
        kernels[key] = {**fused, "points": []}  # the same resampler launch
    return {
        "format": "nicoffload-profile",
        "version": 1,
        "kind": "gpu",
        "machine": {
            k: ev[k]
            for k in (
                "gpu",
                "nvidia_smi",
                "cpu_cores",
                "kernel",
                "torch",
                "cuda",
                "torchvision",
                "cupy",
            )
        },
        "date": ev["date_utc"][:10],
        "method": (
            f"measured: `{ev['command']}` on the device ({ev['date_utc']} UTC). ms per item = a "
            "batch's time / its items, whole device: give the GPU capacity 1. decode_image: nvJPEG "
            "batched (torchvision), wall clock; host-bound and noisy. resize+center_crop+normalize: "
            "CUDA events, device time of the resampler launches; work = planner.cost.chain_work "
            "(resize work limited to the crop window, plus crop and normalize). normalize: dense "
            "224x224 fp16 CHW (one size: a = 0, b = mean). resize, center_crop and their other "
            "chains run the same resampler launch: the fused chain's a, b (not measured apart). "
            "pcie: pinned 256 MiB host-to-device copy, 4 KiB copy latency."
        ),
        "kernels": dict(sorted(kernels.items())),
        "links": {
            "pcie": {
                "latency_ms": ceil["h2d_4KiB_latency_ms"],
                "bandwidth_bytes_per_s": ceil["h2d_pinned_GBps"] * 1e9,
                "cpu_ns_per_byte": 0.0,
            }
        },
    }


def decode_points(torch, sizes) -> list[tuple[float, float]]:
    """ms per item of nvJPEG batched decode at several image sizes: [(items, batch size)]."""
    import torchvision.io as tvio

    pts = []
    for items, bs in sizes:
        h, w = jpeg_size(items[0])
        n = len(items)
        fn = decode_only_fn(torch, tvio, False)
        batches = [items[i : i + bs] for i in range(0, n, bs)]
        fn(batches[0])
        ips, _ = timed(torch, fn, batches * 4)
        pts.append((float(w * h), 1e3 / ips))
    return pts


def jpeg_size(data: bytes) -> tuple[int, int]:
    from nicoffload.ops.gpu_decode import jpeg_header

    h, w, _, _ = jpeg_header(data)
    return h, w


def e2e(out: Path, n: int) -> dict:
    """`nicoffload plan` then `run` for resnet50.yaml on the local topology (host CPU, local
    agent, GPU): measured throughput and per-stage predicted against measured ms per item."""
    cli = [sys.executable, "-m", "nicoffload"]
    plan_file = out / "plan.json"
    plan = subprocess.run(
        [*cli, "plan", RESNET, "--output", str(plan_file), "--json"], capture_output=True, text=True
    )
    if plan.returncode:
        return {"step": "plan", "rc": plan.returncode, "stderr": plan.stderr[-3000:]}
    run = subprocess.run(
        [*cli, "run", RESNET, "--plan", str(plan_file), "--sample", str(n), "--json"],
        capture_output=True,
        text=True,
    )
    if run.returncode:
        return {
            "step": "run",
            "rc": run.returncode,
            "plan": json.loads(plan.stdout),
            "stderr": run.stderr[-3000:],
        }
    got = json.loads(run.stdout)
    return {
        "plan": json.loads(plan.stdout),
        "run": got,
        "stages": {
            name: {
                "predicted_ms_per_item": st.get("predicted_ms_per_item"),
                "measured_ms_per_item": st["ms_per_item"],
            }
            for name, st in got["stages"].items()
        },
    }


def landing(torch, ceil: dict, mib: int = 16, batches: int = 200) -> dict:
    """A shm receiver's batches landed on the GPU (`GpuLanding`: the ring page-locked, one
    asynchronous copy per batch, the slot back after it): the copies' own rate by CUDA events
    against the pinned host-to-device ceiling, and the whole path by wall clock (a sender thread
    memcpying into the ring, as a co-located agent would)."""
    import os
    import threading
    import time

    from nicoffload.transport import connect, listen
    from nicoffload.transport.gpu_landing import GpuLanding

    x = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    rx = listen(f"shm://nicoffload-bench-{os.getpid()}", slots=4, slot_bytes=(mib << 20) + 4096)

    def send() -> None:
        with connect(rx.address) as tx:
            for i in range(batches):
                tx.send({"x": x}, request_id=i)
            tx.flush(timeout=120)

    t = threading.Thread(target=send)
    landed = []  # kept (16 MiB each on the GPU) so the copies are timed after the run
    with rx, GpuLanding(rx, timing=True) as land:
        t.start()
        t0 = time.perf_counter()
        while (d := land.recv(timeout=120)) is not None:
            landed.append(d)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        ok = all(torch.equal(d.tensors["x"].cpu(), torch.from_numpy(x)) for d in landed[-3:])
        # the same registered ring copied again with no sender writing into host memory
        (addr,) = land._registered
        dst = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        rt = land.cupy.cuda.runtime
        idle = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            rt.memcpyAsync(
                dst.data_ptr(),
                addr,
                mib << 20,
                rt.memcpyHostToDevice,
                torch.cuda.current_stream().cuda_stream,
            )
            e1.record()
            e1.synchronize()
            idle.append(e0.elapsed_time(e1))
    t.join()
    copy_ms = [d.copy_ms() for d in landed]
    copy_gbps = (mib << 20) / statistics.median(copy_ms) / 1e6
    return {
        "batch_MiB": mib,
        "batches": batches,
        "copy_GBps_median": copy_gbps,
        "of_pinned_h2d": copy_gbps / ceil["h2d_pinned_GBps"],
        "idle_copy_GBps_median": (mib << 20) / statistics.median(idle) / 1e6,
        "end_to_end_GBps": batches * (mib << 20) / wall / 1e9,
        "last_batches_equal": ok,
        "destination": "pinned-host (no RDMA device on this machine)",
    }


def normalize_bounds(torch, ceil: dict) -> dict:
    """What bounds normalize at 256x224x224x3: our kernel (fp16 and fp32 CHW, fp16 HWC) against
    a copy of the same bytes, torch's own uint8 -> float conversion (same traffic, no
    transpose) and a bare fill of the output alone (writes only)."""
    from nicoffload import ops
    from nicoffload.graph import load_pipeline

    text = Path(RESNET).read_text()
    variants = {
        "ours_fp16_chw": (text, torch.float16, (256, 3, 224, 224)),
        "ours_fp32_chw": (text.replace("dtype: float16", "dtype: float32"), torch.float32,
                          (256, 3, 224, 224)),
        "ours_fp16_hwc": (text.replace("layout: chw", "layout: hwc"), torch.float16,
                          (256, 224, 224, 3)),
    }  # fmt: skip
    x = torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device="cuda")
    res: dict = {"copy_1GiB_GBps": ceil["d2d_copy_GBps"]}
    with tempfile.TemporaryDirectory() as folder:
        for name, (yaml_text, dtype, shape) in variants.items():
            path = Path(folder) / f"{name}.yaml"
            path.write_text(yaml_text)
            fn = ops.get_kernel("normalize", "gpu").build([load_pipeline(path).node("norm")], ())
            y = torch.empty(shape, dtype=dtype, device="cuda")
            ms = cuda_ms(torch, lambda f=fn, y=y: f(x, out=y), reps=30, inner=20)
            moved = x.numel() + y.numel() * y.element_size()
            src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = cuda_ms(torch, lambda s=src, d=dst: d.copy_(s), reps=30, inner=20)
            res[name] = {
                "us": ms * 1e3,
                "GBps": moved / ms / 1e6,
                "of_1GiB_copy": moved / ms / 1e6 / ceil["d2d_copy_GBps"],
                "of_same_size_copy": copy_ms / ms,
            }
    for dtype in (torch.float16, torch.float32):
        y = torch.empty(x.shape, dtype=dtype, device="cuda")
        ms = cuda_ms(torch, lambda y=y: y.copy_(x), reps=30, inner=20)
        moved = x.numel() + y.numel() * y.element_size()
        res[f"torch_uint8_to_{str(dtype)[6:]}"] = {"us": ms * 1e3, "GBps": moved / ms / 1e6}
        ms = cuda_ms(torch, lambda y=y: y.fill_(1.0), reps=30, inner=20)
        res[f"fill_{str(dtype)[6:]}_output"] = {
            "us": ms * 1e3,
            "GBps": y.numel() * y.element_size() / ms / 1e6,
        }
    return res


def stage_phases(torch, stage, items: list[bytes], bs: int = 64, n: int = 60) -> dict:
    """Where a decoding GpuStage's time goes, one batch at a time (medians, ms per batch):
    headers and bytes (`_begin`), the nvJPEG call, views and the kernels' host side
    (`_finish`), the wait for the device; and nvJPEG alone on the same batches, synchronized."""
    import torchvision.io as tvio

    batches = [[items[(k * bs + j) % len(items)] for j in range(bs)] for k in range(n)]
    phases: dict[str, list[float]] = {"begin": [], "decode": [], "finish": [], "wait": []}
    alone = []
    nvjpeg = decode_only_fn(torch, tvio, False)
    for b in batches:
        t0 = time.perf_counter()
        job = stage._begin({"image": b}, 0)
        t1 = time.perf_counter()
        stage._decode(job)
        t2 = time.perf_counter()
        done = stage._finish(job)
        t3 = time.perf_counter()
        done.wait()
        t4 = time.perf_counter()
        for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[key].append(dt * 1e3)
        t0 = time.perf_counter()
        nvjpeg(b)
        torch.cuda.synchronize()
        alone.append((time.perf_counter() - t0) * 1e3)
    out = {k: statistics.median(v) for k, v in phases.items()}
    out["nvjpeg_alone"] = statistics.median(alone)
    out["batch"] = bs
    return out
