"""Cost profiles: what each kernel costs on a device (`a + b * work` ms per item) and what each
link transport costs, as JSON with the machine, date and method written in.

`nicoffload profile` measures them (see `measure`); devices that cannot be measured here (a
BlueField's Arm cores) ship as documented estimates in `nicoffload/data/profiles/`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, ProfileError
from nicoffload.kerneltime import RING, busy_ms

FORMAT = "nicoffload-profile"
# 2: a measured CPU/DPU decode_image is fit at the work of the decode the kernel runs (see
# STALE_DECODE). A version 1 profile is still read where that does not matter: estimates and
# GPU profiles. 3: a decoder's points may carry a third number (the file's bytes, for
# `c_ms_per_byte`), and `runtime` may carry `agent_us_per_item`; versions 1 and 2 are still read.
VERSION = 3
STALE_DECODE = (
    "its decode_image points record each decode's work as a 6/8 DCT-scaled image (the planner's "
    "rule of its day) while the kernel decoded it at full size, so the planner, which prices "
    "the pixels really decoded, would price decode about 16/9 too high with it"
)
SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "profiles"
# The shipped estimate used for a device kind when this machine has no measured profile.
SHIPPED_DEFAULT = {"cpu": "x86-server", "dpu": "bluefield3-arm", "gpu": "h100"}


@dataclass(frozen=True)
class KernelCost:
    """ms per item of one kernel (one op, or a fused chain `a+b+c`) on one core:
    a + b * work, + c * encoded bytes for a kernel whose op has that second feature
    (`ops.OpDef.encoded`: a JPEG decoder's time grows with the file's bytes as well)."""

    a_ms: float
    b_ms: float
    unit: str  # pixels | bytes | tokens
    # (work, measured ms) the fit came from; (work, measured ms, encoded bytes) with c_ms
    points: tuple[tuple[float, ...], ...] = ()
    c_ms: float = 0.0  # per encoded byte

    def ms(self, work: float, encoded: float = 0.0) -> float:
        return self.a_ms + self.b_ms * work + self.c_ms * encoded


# The frame MAC the links' CPU figures were measured under (`transport.integrity`: GMAC since
# 2026-12-02; HMAC-SHA256 before, about 3x the CPU per byte).
FRAME_MAC = "gmac"


@dataclass(frozen=True)
class LinkCost:
    """A transport as measured on a machine; topology files may override any of it."""

    latency_ms: float
    bandwidth: float  # bytes per second, each direction
    cpu_ns_per_byte: float  # CPU time at each CPU endpoint
    # and per batch (frames, credits, the MAC's fixed part); None in a profile measured before
    # links were measured through nicoffload's own transports (its CPU figures are raw sockets')
    cpu_us_per_batch: float | None = 0.0


@dataclass(frozen=True)
class Profile:
    kind: str  # the device kind the kernels were run as: cpu | dpu | gpu
    kernels: dict[str, KernelCost]
    links: dict[str, LinkCost] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    date: str = ""
    method: str = ""  # "measured: ..." or "estimate: ..."
    basis: str = ""  # for estimates: what the numbers are derived from
    source: str = "<memory>"
    # the host runtime's own CPU per item outside the kernels (batching, queues, row status,
    # handing batches out), measured through a real Session (`profiling.measure_runtime`)
    runtime_us_per_item: float | None = None
    # the DPU agent's own CPU per item outside its kernels and its transfers (parsing requests,
    # batching, row status, forwarding), measured through a real agent on these cores
    # (`profiling.measure_agent_runtime`); the planner prices it as CPU on the DPU's cores
    # (planner.cost._agent_ends; not as one process's serial work: it is tens of us per item)
    agent_us_per_item: float | None = None

    def kernel(self, chain: tuple[str, ...] | str) -> KernelCost | None:
        key = chain if isinstance(chain, str) else "+".join(chain)
        return self.kernels.get(key)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "machine": self.machine,
            "date": self.date,
            "method": self.method,
            **({"basis": self.basis} if self.basis else {}),
            "kernels": {
                k: {
                    "a_ms": float(f"{c.a_ms:.5g}"),
                    "b_ms": float(f"{c.b_ms:.5g}"),
                    # fitted with the second feature (points of 3), even where it came out 0
                    **(
                        {"c_ms_per_byte": float(f"{c.c_ms:.5g}")}
                        if c.c_ms or any(len(p) == 3 for p in c.points)
                        else {}
                    ),
                    "unit": c.unit,
                    "points": [list(p) for p in c.points],
                }
                for k, c in sorted(self.kernels.items())
            },
            "links": {
                t: {
                    "latency_ms": c.latency_ms,
                    "bandwidth_bytes_per_s": c.bandwidth,
                    "cpu_ns_per_byte": c.cpu_ns_per_byte,
                    # None (measured before it was): left out, and read back as None
                    **(
                        {}
                        if c.cpu_us_per_batch is None
                        else {"cpu_us_per_batch": c.cpu_us_per_batch, "frame_mac": FRAME_MAC}
                    ),
                }
                for t, c in sorted(self.links.items())
            },
            **(
                {
                    "runtime": {
                        k: v
                        for k, v in (
                            ("host_us_per_item", self.runtime_us_per_item),
                            ("agent_us_per_item", self.agent_us_per_item),
                        )
                        if v is not None
                    }
                }
                if self.runtime_us_per_item is not None or self.agent_us_per_item is not None
                else {}
            ),
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _number(doc: dict, key: str, where: str, source: str) -> float:
    value = doc.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ProfileError(
            f"{where}: '{key}' must be a number >= 0, got {value!r}", Mark(source, 1, 1)
        )
    return float(value)


def profile_from_json(doc: Any, source: str = "<profile>") -> Profile:
    """Check a profile document; any mistake is a ProfileError naming the entry."""
    mark = Mark(source, 1, 1)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f'not a nicoffload profile (no "format": "{FORMAT}")', mark)
    version = doc.get("version")
    if version not in (1, 2, VERSION):
        raise ProfileError(f"profile version {version!r} is not {VERSION}; measure it again", mark)
    kind = doc.get("kind")
    if kind not in ("cpu", "dpu", "gpu"):
        raise ProfileError(f"'kind' must be cpu, dpu or gpu, got {kind!r}", mark)
    measured = str(doc.get("method", "")).startswith("measured")
    if version == 1 and measured and kind != "gpu" and "decode_image" in (doc.get("kernels") or {}):
        raise ProfileError(
            f"a version 1 profile: {STALE_DECODE}; measure it again with "
            f"`nicoffload profile --device {kind}`",
            mark,
        )
    kernels = {}
    for key, body in (doc.get("kernels") or {}).items():
        if not isinstance(body, dict):
            raise ProfileError(f"kernel '{key}' must be a mapping", mark)
        where = f"kernel '{key}'"
        raw = body.get("points", [])
        if not isinstance(raw, list) or not all(
            isinstance(p, list)
            and len(p) in (2, 3)
            and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                for x in p
            )
            for p in raw
        ):
            raise ProfileError(
                f"{where}: 'points' must be a list of [work, ms] or [work, ms, encoded bytes]",
                mark,
            )
        points = tuple(tuple(float(x) for x in p) for p in raw)
        kernels[key] = KernelCost(
            _number(body, "a_ms", where, source),
            _number(body, "b_ms", where, source),
            str(body.get("unit", "")),
            points,
            _number(body, "c_ms_per_byte", where, source) if "c_ms_per_byte" in body else 0.0,
        )
    links = {}
    for name, body in (doc.get("links") or {}).items():
        where = f"link '{name}'"
        if not isinstance(body, dict):
            raise ProfileError(f"{where} must be a mapping", mark)
        links[name] = LinkCost(
            _number(body, "latency_ms", where, source),
            _number(body, "bandwidth_bytes_per_s", where, source) or 1.0,
            _number(body, "cpu_ns_per_byte", where, source),
            # profiles written before it was measured lack it, and a link measured under
            # another frame MAC has CPU figures of another cost: both priced by the defaults
            _number(body, "cpu_us_per_batch", where, source)
            if "cpu_us_per_batch" in body and body.get("frame_mac") == FRAME_MAC
            else None,
        )
    return Profile(
        kind,
        kernels,
        links,
        dict(doc.get("machine") or {}),
        str(doc.get("date", "")),
        str(doc.get("method", "")),
        str(doc.get("basis", "")),
        source,
        *_runtime(doc.get("runtime"), source),
    )


RUNTIME_KEYS = ("host_us_per_item", "agent_us_per_item")


def _runtime(body: Any, source: str) -> tuple[float | None, float | None]:
    """(host_us_per_item, agent_us_per_item) of a profile's `runtime`, each None if absent."""
    if body is None:
        return None, None
    if not isinstance(body, dict) or not body:
        raise ProfileError(
            "'runtime' must be a mapping with " + " or ".join(RUNTIME_KEYS), Mark(source, 1, 1)
        )
    unknown = sorted(set(body) - set(RUNTIME_KEYS))
    if unknown:
        raise ProfileError(
            f"runtime: unknown key '{unknown[0]}' (known: {', '.join(RUNTIME_KEYS)})",
            Mark(source, 1, 1),
        )
    host, agent = (_number(body, k, "runtime", source) if k in body else None for k in RUNTIME_KEYS)
    return host, agent


def load_profile(path: str | Path) -> Profile:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read the profile: {exc}", Mark(str(path), 1, 1)) from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"not JSON: {exc.msg}", Mark(str(path), exc.lineno, exc.colno)) from None
    return profile_from_json(doc, str(path))


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


def profile_path(name: str, base: Path | None = None) -> Path:
    """A shipped profile by name (`bluefield3-arm`), else a file path (relative to `base`)."""
    shipped = SHIPPED_DIR / f"{name}.json"
    if "/" not in name and not name.endswith(".json") and shipped.is_file():
        return shipped
    path = Path(name).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    if not path.is_file():
        raise LookupError(
            f"profile '{name}' is neither a shipped profile ({', '.join(shipped_names())}) nor a file"
        )
    return path


def profiles_dir() -> Path:
    """Where `nicoffload profile` writes this machine's profiles ($NICOFFLOAD_PROFILES)."""
    default = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nicoffload" / "profiles"
    )
    return Path(os.environ.get("NICOFFLOAD_PROFILES", default))


def measured_path(kind: str) -> Path:
    return profiles_dir() / f"{kind}.json"


def default_profile_for(kind: str) -> str:
    """This machine's measured profile of a kind if there is one, else the shipped estimate."""
    measured = measured_path(kind)
    return (
        str(measured) if measured.is_file() else str(SHIPPED_DIR / f"{SHIPPED_DEFAULT[kind]}.json")
    )


# -- measurement -------------------------------------------------------------------------------

# Image sizes swept, each followed by a resize to 0.7x its shorter side: too little shrinking for
# any DCT scale (`ops.decode.decoded_size` wants 3x left after it), so every decode is at full
# size, as ResNet's 375x500 -> 256 is, and the work recorded is the pixels really decoded
# (`planner.cost.chain_work`, from the same decoded_size). A DCT-scaled decode (1/2, 1/4, 1/8) is
# priced from this fit by its decoded pixels, which leaves out that it still entropy-decodes the
# whole file.
IMAGE_SIZES = ((188, 250), (375, 500), (564, 752), (750, 1000))
TOKEN_LENGTHS = (32, 128, 512)
PHOTOS = 3  # photos per size: JPEG decode time depends on the content
DECODE_QUALITIES = (50, 97)  # besides 90: the decoder's points at other bytes per pixel
_IMAGE_PIPELINE = """\
name: profile-image
inputs: {{image: {{kind: bytes, format: jpeg, typical: {{height: {h}, width: {w}, bytes: {nbytes}}}}}}}
nodes:
  - {{name: decode, op: decode_image, in: image}}
  - {{name: resize, op: resize, in: decode, params: {{shorter: {short}}}}}
  - {{name: crop, op: center_crop, in: resize, params: {{size: {crop}}}}}
  - {{name: norm, op: normalize, in: crop, params: {{mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225], dtype: float16}}}}
outputs: {{pixels: norm}}
"""
_TEXT_PIPELINE = """\
name: profile-text
inputs: {{text: {{kind: text, typical: {{chars: {chars}}}}}}}
nodes:
  - {{name: tok, op: tokenize, in: text, params: {{max_length: {tokens}}}}}
outputs: {{ids: tok.input_ids, mask: tok.attention_mask}}
"""


def _jpeg(h: int, w: int, seed: int, quality: int = 90) -> bytes:
    """A photo-like JPEG of h x w: a shipped sample photo rescaled, else smooth noise."""
    import numpy as np
    import simplejpeg
    from PIL import Image

    try:
        from nicoffload.samples import sample_image

        _, data = sample_image(seed)
        img = np.asarray(Image.open(__import__("io").BytesIO(data)).convert("RGB").resize((w, h)))
    except Exception:  # no sample photos: low-frequency noise compresses like a photo
        rng = np.random.default_rng(seed)
        small = rng.integers(0, 255, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))
    return simplejpeg.encode_jpeg(
        np.ascontiguousarray(img), quality=quality, colorsubsampling="420"
    )


def _pipelines(directory: Path, quick: bool):
    """(pipeline, input values by name, the ops to time or None for all) for each case of the
    sweep: each size at quality 90 for every kernel, and again at other qualities for the
    decoder alone (its time grows with the file's bytes as well as its pixels: the two are
    fitted apart)."""
    from nicoffload.graph import load_pipeline
    from nicoffload.samples import sample_text

    sizes = IMAGE_SIZES[:3] if quick else IMAGE_SIZES
    for i, (h, w) in enumerate(sizes):
        for quality in (90, *DECODE_QUALITIES):
            photos = [_jpeg(h, w, seed, quality) for seed in range(PHOTOS)]
            nbytes = sum(map(len, photos)) // len(photos)
            short = int(h * 0.7)
            text = _IMAGE_PIPELINE.format(
                h=h, w=w, nbytes=nbytes, short=short, crop=min(224, short)
            )
            path = directory / f"image{i}q{quality}.yaml"
            path.write_text(text)
            only = None if quality == 90 else {"decode_image"}
            yield load_pipeline(path), [{"image": data} for data in photos], only
    for i, n in enumerate(TOKEN_LENGTHS[:2] if quick else TOKEN_LENGTHS):
        words = " ".join(sample_text(j)[1] for j in range(n // 8 + 1))[: int(n * 4.5)]
        path = directory / f"text{i}.yaml"
        path.write_text(_TEXT_PIPELINE.format(chars=len(words), tokens=n))
        yield load_pipeline(path), [{"text": words}], None


def cores() -> int:
    """The cores this process may run on: how many workers a run of this device keeps busy."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares a + b * work with a, b >= 0."""
    import numpy as np

    w, t = np.array(points).T
    if len(points) > 1 and np.ptp(w) > 0:
        b, a = np.polyfit(w, t, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
        if b >= 0:
            return 0.0, float((w @ t) / (w @ w))
    return float(t.mean()), 0.0


def fit_encoded(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least-squares a + b * work + c * encoded bytes with a, b, c >= 0, from (work, ms,
    encoded) points; (a, b, 0) from `fit` when the points cannot tell the two features apart."""
    import numpy as np
    from scipy.optimize import nnls

    w, t, e = np.array(points, dtype=float).T
    A = np.c_[np.ones_like(w), w, e]
    if len(points) < 3 or np.linalg.matrix_rank(A) < 3:
        return (*fit([(x, y) for x, y, _ in points]), 0.0)
    scale = np.maximum(A.max(axis=0), 1e-12)  # columns of like size: nnls is better conditioned
    coef, _ = nnls(A / scale, t)
    a, b, c = coef / scale
    return float(a), float(b), float(c)


def _upstream(pipeline, kind: str, inputs: dict) -> dict:
    """Every value of one item through the pipeline: the real inputs each kernel will read."""
    import copy

    from nicoffload import ops

    values = dict(inputs)
    for node in pipeline.nodes:
        fn = ops.get_kernel(node.op, kind).build([node], ops.kernel_consumers(pipeline, node.name))
        out = fn(*(values[str(r)] for r in node.inputs))
        outs = out if len(node.out_specs) > 1 else (out,)
        for port, value in zip(node.out_specs, outs, strict=True):
            values[node.name if port == "out" else f"{node.name}.{port}"] = copy.deepcopy(value)
    return values


def measure_kernels(
    kind: str,
    *,
    quick: bool = False,
    budget_s: float = 0.25,
    progress=None,
    threads: int | None = None,
) -> dict[str, KernelCost]:
    """Run every kernel registered for `kind` on the sweep, on `threads` workers at once (all
    the cores this process may use, by default), and fit each one's a + b * work."""
    import tempfile
    import time

    from nicoffload import ops
    from nicoffload.planner.cost import chain_work

    kernels = [k for k in ops.all_kernels() if k.device == kind]
    points: dict[str, list[tuple[float, float]]] = {}
    units: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = list(_pipelines(Path(tmp), quick))
        if progress:
            progress(total=len(cases) * len(kernels))
        for pipeline, variants, only in cases:
            nodes = list(pipeline.nodes)
            valuesets = [_upstream(pipeline, kind, inputs) for inputs in variants]
            ops_seq = [n.op for n in nodes]
            for k in kernels:
                at = next(
                    (i for i in range(len(nodes)) if tuple(ops_seq[i : i + len(k.ops)]) == k.ops),
                    None,
                )
                if at is not None and (only is None or set(k.ops) <= only):
                    chain = nodes[at : at + len(k.ops)]
                    # built as the runtime builds it (`runtime.stage.bind_steps`)
                    fn = k.build(chain, ops.kernel_consumers(pipeline, chain[-1].name))
                    args = [[v[str(r)] for r in chain[0].inputs] for v in valuesets]
                    specs = list(chain[-1].out_specs.values())
                    if kind == "gpu":  # one host thread feeds the GPU; its time is wall time
                        ms = busy_ms(fn, args, specs, 1, budget_s, time.perf_counter)
                    else:
                        ms = busy_ms(fn, args, specs, threads or cores(), budget_s)
                    key = "+".join(k.ops)
                    work = chain_work(pipeline, [n.name for n in chain])
                    head = chain[0]
                    encoded = head.opdef().encoded
                    point = (work, ms)
                    if encoded is not None:
                        point += (encoded(head.params, head.in_specs, head.out_specs),)
                    points.setdefault(key, []).append(point)
                    units[key] = head.opdef().work_unit
                if progress:
                    progress(advance=1)
    out = {}
    for key, p in points.items():
        if len(p[0]) == 3:
            a, b, c = fit_encoded(p)
            out[key] = KernelCost(a, b, units[key], tuple(p), c)
        else:
            out[key] = KernelCost(*fit(p), units[key], tuple(p))
    return out


def measure_links(*, quick: bool = False) -> dict[str, LinkCost]:
    """tcp and shm as the runtime moves bytes over them (`profiling.measure_transports`)."""
    from nicoffload.profiling import measure_transports

    return measure_transports(quick=quick)


def machine_info() -> dict[str, Any]:
    import platform

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": cores(),
        "host": platform.node(),
        "python": platform.python_version(),
    }


def measure(
    kind: str = "cpu",
    *,
    quick: bool = False,
    progress=None,
    budget_s: float = 0.25,
    threads: int | None = None,
) -> Profile:
    """A measured profile of this machine's cores run as `kind` (cpu, or dpu on a DPU)."""
    import datetime

    threads = threads or cores()
    kernels = measure_kernels(
        kind, quick=quick, progress=progress, budget_s=budget_s, threads=threads
    )
    links = measure_links(quick=quick) if kind in ("cpu", "dpu") else {}
    sizes = ", ".join(f"{h}x{w}" for h, w in (IMAGE_SIZES[:3] if quick else IMAGE_SIZES))
    how = (
        "one host thread, wall time per call"
        if kind == "gpu"
        else f"{threads} worker threads at once (every core busy, as in a run), "
        "CPU time per call of each worker"
    )
    method = (
        f"measured: each registered {kind} kernel on {how}, each worker going round {RING} "
        "items with their own input and output buffers, median of 5 rounds per size, "
        f"on JPEGs of {sizes} (resize to 0.7x, so decode is at full size) and texts of "
        f"{', '.join(map(str, TOKEN_LENGTHS))} tokens; fit a + b * work by least squares; "
        "links: nicoffload's own tcp (every frame MAC'd) and shm transports, keyed as the agent keys "
        "them, CPU of both ends fitted a + b * bytes per batch"
    )
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    runtime = agent = None
    if kind == "cpu":
        from nicoffload.profiling import measure_runtime

        runtime = measure_runtime(quick=quick)
    if kind in ("cpu", "dpu") and "tcp" in links:
        # an agent on these cores (the local topology's emulated DPU, or on a DPU the agent
        # itself), over tcp as it serves; None where the machine has one core
        from nicoffload.profiling import measure_agent_runtime

        agent = measure_agent_runtime(links["tcp"], quick=quick)
    return Profile(
        kind, kernels, links, machine_info(), date, method, "", "<measured>", runtime, agent
    )
