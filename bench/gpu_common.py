"""Shared pieces of the GPU benchmarks: realistic JPEGs from scikit-image's photographs and
timers (CUDA events, host clocks, wall clock over batches)."""

from __future__ import annotations

import io
import os
import statistics
import time
from multiprocessing import Pool

import numpy as np

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
RESNET = "pipelines/resnet50.yaml"
# torchvision keeps one nvJPEG decoder per process and rebuilds it (leaking the old one) when
# the device argument changes ("cuda" vs "cuda:0"): every method here names the same device.
CUDA0 = "cuda:0"
_PHOTOS: list | None = None  # per worker process, loaded on first use


def _photos():
    import skimage.data

    names = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry")
    ps = [np.ascontiguousarray(getattr(skimage.data, n)()[..., :3]) for n in names]
    ps.append(skimage.data.stereo_motorcycle()[0])
    return ps


def make_jpeg(args: tuple[int, int, int]) -> bytes:
    """One photo-like JPEG (crop of a photograph, sharpened, sensor noise), quality 94, 4:2:0."""
    from PIL import Image, ImageFilter

    global _PHOTOS
    if _PHOTOS is None:
        _PHOTOS = _photos()
    i, w, h = args
    rng = np.random.default_rng([7, i, w])
    p = _PHOTOS[i % len(_PHOTOS)]
    ph, pw = p.shape[:2]
    f = rng.uniform(0.5, 1.0)
    cw, ch = pw * f, pw * f * h / w
    if ch > ph:
        ch, cw = ph, ph * w / h
    x0, y0 = rng.uniform(0, pw - cw), rng.uniform(0, ph - ch)
    im = Image.fromarray(p).resize((w, h), Image.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    im = im.filter(ImageFilter.UnsharpMask(radius=1.5, percent=150, threshold=1))
    noise = rng.normal(0, 3.5, (h, w, 1)) + rng.normal(0, 1.5, (h, w, 3))
    a = np.clip(np.asarray(im, np.float64) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=94, subsampling=2)
    return buf.getvalue()


def dataset(n: int, w: int, h: int) -> list[bytes]:
    with Pool(min(16, os.cpu_count() or 1)) as pool:
        return pool.map(make_jpeg, [(i, w, h) for i in range(n)], chunksize=8)


def cuda_ms(torch, fn, reps: int = 30, warm: int = 5, inner: int = 1) -> float:
    """Median device time of fn() in ms, by CUDA events; `inner` back-to-back calls per timing
    so that the host's launch cost overlaps the device work (device time, not launch latency)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(inner):
            fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / inner)
    return statistics.median(times)


def host_ms(fn, reps: int = 20) -> float:
    """Median host time of fn() in ms (what the calling thread spends; no device sync)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_only_fn(torch, tvio, pinned: bool):
    buf = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True) if pinned else None
    bufnp = buf.numpy() if pinned else None

    def run(batch: list[bytes]):
        if pinned:
            ts, o = [], 0
            for b in batch:
                n = len(b)
                bufnp[o : o + n] = np.frombuffer(b, np.uint8)
                ts.append(buf[o : o + n])
                o += (n + 255) // 256 * 256
        else:
            ts = [torch.frombuffer(b, dtype=torch.uint8) for b in batch]
        return tvio.decode_jpeg(ts, device=CUDA0)

    return run


def timed(torch, fn, batches, sync_each=True) -> tuple[float, float]:
    """(images/s by wall clock, host CPU ms per image) over all batches, outputs consumed."""
    n = sum(len(b) for b in batches)
    torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    for b in batches:
        fn(b)
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return n / wall, (time.process_time() - c0) * 1e3 / n
