"""ResNet-50 preprocessing on one CPU core: our kernels vs Pillow + numpy vs OpenCV, and decode alone.

    python bench/bench_cpu.py [--quick] [--json] [--n N] [--output bench/RESULTS_cpu.md]

One process, pinned to one core, numba and OpenCV held to one thread, on the sample corpus (mixed
sizes). Every method turns the same JPEG bytes into the same float16 CHW 3x224x224 tensor:
ours (decode kernel with DCT scaling -> fused resize/crop/normalize kernel), Pillow + numpy
(torchvision's recipe), OpenCV (imdecode, resize INTER_AREA/LINEAR, crop, numpy normalize);
plus decode alone, at the scale our pipeline decodes at and at full size. Methods run
interleaved over several rounds; per image the least CPU time counts. Writes the table to --output.
The target (issue #18): ours >= 0.85x the throughput of decode alone at our DCT scale.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
TARGET_OF_DECODE = 0.85  # ours / decode-only throughput (issue #18; replaced 4x Pillow)


def torchvision_size(h: int, w: int, shorter: int = 256) -> tuple[int, int]:
    return (shorter, int(shorter * w / h)) if h <= w else (int(shorter * h / w), shorter)


def crop_offsets(h: int, w: int, size: int = 224) -> tuple[int, int]:
    return round((h - size) / 2.0), round((w - size) / 2.0)


def pil_numpy(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        img = im.convert("RGB")
    oh, ow = torchvision_size(img.height, img.width)
    img = img.resize((ow, oh), Image.BILINEAR)
    top, left = crop_offsets(oh, ow)
    img = img.crop((left, top, left + 224, top + 224))
    x = np.asarray(img, np.float32) / 255.0
    return ((x - MEAN) / STD).transpose(2, 0, 1).astype(np.float16)


def opencv(data: bytes) -> np.ndarray:
    import cv2

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    h, w = img.shape[:2]
    oh, ow = torchvision_size(h, w)
    interp = cv2.INTER_AREA if oh < h else cv2.INTER_LINEAR
    img = cv2.resize(img, (ow, oh), interpolation=interp)
    top, left = crop_offsets(oh, ow)
    x = img[top : top + 224, left : left + 224, ::-1].astype(np.float32) / 255.0
    return ((x - MEAN) / STD).transpose(2, 0, 1).astype(np.float16)


def methods() -> dict:
    from nicoffload.graph import load_pipeline
    from nicoffload.ops import get_kernel

    pipe = load_pipeline(ROOT / "pipelines/resnet50.yaml")
    dec_node, chain = pipe.node("decode"), [pipe.node(n) for n in ("resize", "crop", "norm")]
    decode = get_kernel("decode_image", "cpu").build([dec_node], pipe.consumers("decode"))
    full = get_kernel("decode_image", "cpu").build([dec_node], ())  # no consumer: full size
    fused = get_kernel(("resize", "center_crop", "normalize"), "cpu").build(chain, ())
    out = np.empty((3, 224, 224), np.float16)
    return {
        "ours": lambda data: fused(decode(data), out=out),
        "pil_numpy": pil_numpy,
        "opencv": opencv,
        "decode_dct": decode,
        "decode_full": full,
    }


def run(images: list[bytes], fns: dict, rounds: int) -> dict[str, np.ndarray]:
    """CPU seconds of each method on each image: the least over rounds, which run interleaved
    (the method order rotating). CPU time of this pinned thread, where every method does all its
    work: unlike wall time it does not count moments when other processes hold the core, and the
    least of several runs drops what their cache pollution adds (timeit's rule)."""
    times = {name: np.zeros((rounds, len(images))) for name in fns}
    names = list(fns)
    clock = time.thread_time
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, row = fns[name], times[name][r]
            for i, data in enumerate(images):
                start = clock()
                fn(data)
                row[i] = clock() - start
    return {name: t.min(axis=0) for name, t in times.items()}


def size_class(pixels: int) -> str:
    return "<= 0.25 MP" if pixels <= 250_000 else ("<= 1 MP" if pixels <= 1_000_000 else "> 1 MP")


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = re.search(r"Model name:\s*(.+)", out)
        return model.group(1).strip() if model else platform.processor()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()


ROWS = (
    ("ours: decode (DCT-scaled) + fused resize/crop/normalize", "ours"),
    ("Pillow + numpy (torchvision recipe)", "pil_numpy"),
    ("OpenCV (imdecode, resize AREA/LINEAR, crop, numpy normalize)", "opencv"),
    ("decode only, at our DCT scale", "decode_dct"),
    ("decode only, full size", "decode_full"),
)


def markdown(res: dict) -> str:
    s, classes = res["s_per_image"], res["classes"]
    names = list(classes)
    lines = [
        "# CPU preprocessing benchmark (ResNet-50 recipe, one core)",
        "",
        f"- date: {res['date']}",
        f"- machine: {res['machine']} ({os.cpu_count()} logical CPUs), pinned to one core",
        f"- command: `{res['command']}`",
        f"- load average (1 min) at start / end: {res['load'][0]:.2f} / {res['load'][1]:.2f}",
        f"- corpus: {res['corpus']['images']} sample JPEGs ({res['corpus']['summary']})",
        f"- timing: {res['rounds']} interleaved rounds; per image the least CPU time of the "
        "benchmark thread over the rounds (other load on a shared machine does not count); "
        "output float16 CHW 3x224x224 for every pipeline",
        "",
        "| method | images/s per core | ms/image | "
        + " | ".join(f"ms/image, {c} ({classes[c]['n']})" for c in names)
        + " |",
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    for label, k in ROWS:
        per = " | ".join(f"{classes[c][k] * 1000:.2f}" for c in names)
        lines.append(f"| {label} | {1 / s[k]:.0f} | {s[k] * 1000:.2f} | {per} |")
    r = res["ratios"]
    lines += [
        "",
        f"- ours / decode only at our DCT scale, throughput: **{r['of_decode_dct']:.3f}x** "
        f"(target >= {TARGET_OF_DECODE}x: {'met' if r['of_decode_dct'] >= TARGET_OF_DECODE else 'not met'}); "
        f"in time, ours costs {r['over_decode_dct']:.3f}x decode's",
        f"- ours vs Pillow + numpy: {r['speedup_vs_pil']:.2f}x (the ceiling, Pillow + numpy / "
        f"decode only: {r['ceiling_vs_pil']:.2f}x); ours vs OpenCV: {r['speedup_vs_opencv']:.2f}x",
        f"- ours / decode only at full size: {r['over_decode_full']:.2f}x",
        "",
        "Notes. Decoding is libjpeg-turbo in every method (Pillow, OpenCV and simplejpeg bundle",
        "it), and entropy decoding is most of it, so decode alone bounds any speedup over",
        "Pillow + numpy: the ceiling line above. DCT scaling only uses libjpeg-turbo's 1/2, 1/4",
        "and 1/8 reduced IDCTs (its 5/8-7/8 ones decode slower than full size) and only where the",
        "resize still shrinks 3x after it (below that the accuracy bound breaks); with a 256-pixel",
        f"target, photos whose shorter side is 1536 pixels or more: {res['corpus']['dct_scaled']}",
        "in this corpus.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer images and rounds")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--n", type=int, default=None, help="images in the corpus")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7)")
    ap.add_argument("--output", default=str(ROOT / "bench/RESULTS_cpu.md"))
    args = ap.parse_args(argv)
    n = args.n or (60 if args.quick else 400)
    rounds = args.rounds or (3 if args.quick else 7)
    load0 = os.getloadavg()[0]

    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    import cv2
    import numba

    numba.set_num_threads(1)
    cv2.setNumThreads(1)

    from nicoffload.samples import sample_images

    print(f"building {n} sample images ...", file=sys.stderr)
    corpus = sample_images(n)
    images = [data for _, data in corpus]
    fns = methods()
    for fn in fns.values():  # warm every path (imports, JIT, caches) outside the timing
        for data in images[:3]:
            fn(data)
    print(f"timing {len(fns)} methods x {rounds} rounds on core {core} ...", file=sys.stderr)
    per_image = run(images, fns, rounds)
    dims = [tuple(map(int, re.search(r"_(\d+)x(\d+)_", name).groups())) for name, _ in corpus]
    labels = np.array([size_class(w * h) for w, h in dims])
    classes = {}
    for c in ("<= 0.25 MP", "<= 1 MP", "> 1 MP"):
        mask = labels == c
        if mask.any():
            classes[c] = {"n": int(mask.sum())} | {
                k: float(t[mask].mean()) for k, t in per_image.items()
            }
    s = {k: float(t.mean()) for k, t in per_image.items()}
    import simplejpeg

    scaled = sum(
        fns["decode_dct"](d).shape[0] < simplejpeg.decode_jpeg_header(d)[0] for d in images
    )
    summary = (
        f"{np.mean([len(d) for d in images]) / 1024:.0f} KB mean; 500x375 to 1920x1080: "
        + ", ".join(f"{v['n']} of {c}" for c, v in classes.items())
        + f"; {scaled} decoded DCT-scaled by the resnet50 rule"
    )
    res = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": shlex.join(["python", "bench/bench_cpu.py", *(argv or sys.argv[1:])]),
        "corpus": {"images": n, "summary": summary, "dct_scaled": int(scaled)},
        "rounds": rounds,
        "load": (load0, os.getloadavg()[0]),
        "s_per_image": s,
        "classes": classes,
        "ratios": {
            "ceiling_vs_pil": s["pil_numpy"] / s["decode_dct"],
            "speedup_vs_pil": s["pil_numpy"] / s["ours"],
            "speedup_vs_opencv": s["opencv"] / s["ours"],
            "over_decode_dct": s["ours"] / s["decode_dct"],
            "of_decode_dct": s["decode_dct"] / s["ours"],
            "over_decode_full": s["ours"] / s["decode_full"],
        },
    }
    text = markdown(res)
    Path(args.output).write_text(text)
    print(json.dumps(res, indent=2) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
