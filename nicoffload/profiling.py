"""Measuring this machine for a profile (`nicoffload profile`; `profiles.py` is the format):
each registered kernel over a sweep of sizes (`measure_kernels`), the runtime's own CPU per item
on the host and on an agent (`measure_runtime`, `measure_agent_runtime`), the host process's
serial (GIL-held) time per item of a host stage (`profiling_serial`), and the links
(`profiling_links`: each transport the local topology uses, as the runtime moves bytes).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.kerneltime import RING, busy_ms
from nicoffload.procstat import agent_pids, cores, tree_cpu_s
from nicoffload.profiles import KernelCost, LinkCost, Profile
from nicoffload.profiling_fit import fit, fit_encoded, ratio
from nicoffload.profiling_links import STREAM_BYTES, measure_transports
from nicoffload.profiling_serial import measure_host_serial, serial_method, serial_terms

SMALL_BATCH = 4  # the agent probe's second batch size (its per-batch cost, against 64)


def _probe(
    name: str,
    device: str,
    clock: Any,
    *,
    quick: bool,
    topology: Any = None,
    workers=None,
    batch: int | None = None,
    n: int | None = None,
) -> tuple[float, Any, int, Any, bytes]:
    """A probe pipeline (`data/NAME.yaml`) all on `device`, run through a real Session over
    tiny JPEGs (the kernels cost little: what is left is the runtime's own work), warmed, then
    one call with its batches read in place: (`clock`'s seconds over the call, its RunStats,
    its batches, the pipeline, the item). `batch`: the batch size instead of the pipeline's;
    `n`: the items of the call (512 quick, else 2048)."""
    import io

    from PIL import Image

    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import single_device_plan
    from nicoffload.runner import RunStats, prepare
    from nicoffload.session import Session

    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(buf, "JPEG")
    pipeline = load_pipeline(Path(__file__).parent / "data" / f"{name}.yaml")
    if batch is not None:
        pipeline = replace(pipeline, batch_max_size=batch)
    items = [buf.getvalue()] * (n or (512 if quick else 2048))
    plan = single_device_plan(pipeline, device)
    with Session(prepare(pipeline, plan, topology), workers=workers) as session:
        for _ in session.stream(items[:128]):  # warm: kernels compiled, rings touched
            pass
        stats = RunStats()
        c0, batches = clock(), 0
        for _ in session.stream(items, stats):
            batches += 1
        spent = clock() - c0
    return spent, stats, batches, pipeline, items[0]


def _per_item_us(spent_s: float, stats: Any, items: int) -> float:
    """`spent_s` per item in us, less what the call's kernels took."""
    kernels_ms = sum(st["ms_per_item"] for st in stats.stages.values())
    return spent_s * 1e6 / items - kernels_ms * 1e3


def measure_runtime(*, quick: bool = False) -> float:
    """The host runtime's CPU per item outside the kernels, in us: the ResNet pipeline
    (`data/runtime_probe.yaml`) all on the host over tiny JPEGs, batches read in place as `run`
    and a serving loop read them; this process's CPU over the call minus what its kernels
    took, per item."""
    n = 512 if quick else 2048
    cpu, stats, _, _, _ = _probe("runtime_probe", "cpu", time.process_time, quick=quick)
    return max(0.0, _per_item_us(cpu, stats, n))


def measure_agent_runtime(link: LinkCost, *, quick: bool = False) -> tuple[float, float] | None:
    """The DPU agent's own CPU outside its kernels and its transfers, in us, as (per item, per
    batch): a probe (`data/agent_probe.yaml`: the ResNet recipe's kernels over tiny JPEGs, to a
    tiny output) all on an agent started on these cores, as the local topology runs one, over
    tcp, at batches of the probe's 64 and of SMALL_BATCH; at each, the agent process's CPU over
    the call minus what its kernels took (the agent's own figure) and minus both its transfers
    as `link` prices them, per item; then fitted a + b / batch size through the two. A batch
    costs the agent a REQUEST frame parsed, a batch formed and forwarded, credits: 0.5-0.6 ms
    of one VM core, where a batch of 2 items costs 0.3 ms per item and one of 64 items 0.03.
    None where no agent can run beside the host (one core)."""
    from nicoffload.topology import local_topology

    topology = local_topology(gpu=False)
    if "dpu0" not in topology.ids:
        return None
    others = set(agent_pids())  # agents already running (a test's, a server's): not the probe's

    def probe_cpu_s() -> float:
        return sum(tree_cpu_s(pid) for pid in agent_pids() if pid not in others)

    rest: dict[int, float] = {}
    # the small batches' call takes about as much of the agent's CPU as the full ones': its
    # CPU is read in 10 ms ticks, one of which over 128 items moved the per-batch fit 0.3 ms
    for batch, n in ((None, 512 if quick else 2048), (SMALL_BATCH, 1024 if quick else 2048)):
        cpu, stats, batches, pipeline, item = _probe(
            "agent_probe", "dpu0", probe_cpu_s, quick=quick, topology=topology, workers=1,
            batch=batch, n=n,
        )  # fmt: skip
        out_bytes = sum(s.typical_nbytes for s in pipeline.output_specs().values())
        moved_us = (
            link.cpu_ns_per_byte * (out_bytes + len(item)) * 1e-3
            + 2 * (link.cpu_us_per_batch or 0.0) * batches / n
        )
        rest[n / batches] = _per_item_us(cpu, stats, n) - moved_us
    (big, at_big), (small, at_small) = sorted(rest.items(), reverse=True)
    per_batch = max(0.0, (at_small - at_big) / (1 / small - 1 / big))
    if at_big - per_batch / big < 0:  # all of it per batch: priced right at full batches
        return 0.0, max(0.0, at_big * big)
    return at_big - per_batch / big, per_batch


def with_gpu_serial(base: Profile, *, quick: bool = False, device: str = "gpu0") -> Profile:
    """A GPU profile (measured batched by `bench/bench_gpu.py`, or shipped) with the host
    process's serial time per item of a GPU stage measured here (`measure_host_serial` on
    `device`): the kernels' figures are the GPU's, this part is the host's Python around them."""
    import datetime

    fits, info = measure_host_serial(device, quick=quick)
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    what = f"a GPU stage, measured {when} on {machine_info()['cpu']}"
    method = f"{base.method}; {serial_method(what, device, info)}"
    return replace(base, method=method, **serial_terms(fits))


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


def _jpeg(h: int, w: int, seed: int, quality: int = 90, progressive: bool = False) -> bytes:
    """A photo-like JPEG of h x w: a shipped sample photo rescaled, else smooth noise; 4:2:0,
    baseline or progressive."""
    import io

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
    if progressive:  # simplejpeg encodes baseline only
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(img)).save(
            buf, "JPEG", quality=quality, subsampling="4:2:0", progressive=True
        )
        return buf.getvalue()
    return simplejpeg.encode_jpeg(
        np.ascontiguousarray(img), quality=quality, colorsubsampling="420"
    )


def _pipelines(directory: Path, quick: bool):
    """(pipeline, input values by name, the ops to time or None for all, progressive) for each
    case of the sweep: each size at quality 90 for every kernel, and again at other qualities
    for the decoder alone (its time grows with the file's bytes as well as its pixels: the two
    are fitted apart), and as progressive JPEGs of the same photos at quality 90 for the
    decoder alone (`KernelCost.progressive_x`: their time over the baseline ones')."""
    from nicoffload.graph import load_pipeline
    from nicoffload.samples import sample_text

    sizes = IMAGE_SIZES[:3] if quick else IMAGE_SIZES
    for i, (h, w) in enumerate(sizes):
        for quality, progressive in [
            (90, False),
            *((q, False) for q in DECODE_QUALITIES),
            (90, True),
        ]:
            photos = [_jpeg(h, w, seed, quality, progressive) for seed in range(PHOTOS)]
            nbytes = sum(map(len, photos)) // len(photos)
            short = int(h * 0.7)
            text = _IMAGE_PIPELINE.format(
                h=h, w=w, nbytes=nbytes, short=short, crop=min(224, short)
            )
            path = directory / f"image{i}q{quality}{'p' if progressive else ''}.yaml"
            path.write_text(text)
            only = None if quality == 90 and not progressive else {"decode_image"}
            yield load_pipeline(path), [{"image": data} for data in photos], only, progressive
    for i, n in enumerate(TOKEN_LENGTHS[:2] if quick else TOKEN_LENGTHS):
        words = " ".join(sample_text(j)[1] for j in range(n // 8 + 1))[: int(n * 4.5)]
        path = directory / f"text{i}.yaml"
        path.write_text(_TEXT_PIPELINE.format(chars=len(words), tokens=n))
        yield load_pipeline(path), [{"text": words}], None, False


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

    from nicoffload import ops
    from nicoffload.planner.cost import chain_work

    kernels = [k for k in ops.all_kernels() if k.device == kind]
    points: dict[str, list[tuple[float, float]]] = {}
    units: dict[str, str] = {}
    # per kernel, per (case size) ms of the baseline q90 photos and of the same as progressive
    baseline: dict[str, dict[tuple, float]] = {}
    progressives: dict[str, dict[tuple, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = list(_pipelines(Path(tmp), quick))
        if progress:
            progress(total=len(cases) * len(kernels))
        for pipeline, variants, only, progressive in cases:
            nodes = list(pipeline.nodes)
            valuesets = [_upstream(pipeline, kind, inputs) for inputs in variants]
            ops_seq = [n.op for n in nodes]
            for k in kernels:
                at = next(
                    (i for i in range(len(nodes)) if tuple(ops_seq[i : i + len(k.ops)]) == k.ops),
                    None,
                )
                if progressive and kind == "gpu":  # the GPU decoder hands those to host threads
                    at = None
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
                    units[key] = head.opdef().work_unit
                    if progressive:  # not a point of the fit: the same photos, progressive
                        progressives.setdefault(key, {})[work] = ms
                        if progress:
                            progress(advance=1)
                        continue
                    if encoded is not None:
                        point += (encoded(head.params, head.in_specs, head.out_specs),)
                        if only is None:  # quality 90: the baseline of the progressive case
                            baseline.setdefault(key, {})[work] = ms
                    points.setdefault(key, []).append(point)
                if progress:
                    progress(advance=1)
    out = {}
    for key, p in points.items():
        if len(p[0]) == 3:
            a, b, c = fit_encoded(p)
            out[key] = KernelCost(a, b, units[key], tuple(p), c, ratio(progressives, baseline, key))
        else:
            out[key] = KernelCost(*fit(p), units[key], tuple(p))
    return out


def measure_links(*, quick: bool = False) -> dict[str, LinkCost]:
    """tcp and shm as the runtime moves bytes over them (`measure_transports`)."""
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
        "them, CPU of both ends fitted a + b * bytes per batch, bandwidth from another process at "
        f"{STREAM_BYTES >> 20} MiB batches"
    )
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    runtime = agent = None
    serial: dict[str, float] = {}
    if kind == "cpu":
        runtime = measure_runtime(quick=quick)
        fits, info = measure_host_serial(quick=quick)
        serial = serial_terms(fits)
        method += f"; {serial_method('a host stage', 'cpu', info)}"
    if kind in ("cpu", "dpu") and "tcp" in links:
        # an agent on these cores (the local topology's emulated DPU, or on a DPU the agent
        # itself), over tcp as it serves; None where the machine has one core
        agent = measure_agent_runtime(links["tcp"], quick=quick)
    return Profile(
        kind,
        kernels,
        links,
        machine_info(),
        date,
        method,
        "",
        "<measured>",
        runtime,
        None if agent is None else agent[0],
        **serial,
        agent_us_per_batch=None if agent is None else agent[1],
    )
