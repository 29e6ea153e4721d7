"""bench_gpu.py's `session` and `decoders` sections: the all-GPU plan through a Session beside
nvJPEG alone, the torchvision recipe and the GPU stage alone (same JPEGs, same process, rounds in
rotating order), where the host CPU goes per thread, a second call's first-batch latency; and
nvImageCodec's decoder backends (the hardware JPEG engines, the CUDA decoder, both) beside
torchvision's nvJPEG, alone and side by side on shares of each batch.

    PYTHONPATH=. python3 bench/bench_gpu.py --out OUT_DIR --sections session,decoders
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from gpu_common import CUDA0, RESNET, decode_only_fn, timed

TICK = os.sysconf("SC_CLK_TCK")


class ThreadCpu:
    """CPU seconds per thread of this process while a region runs, by thread name (Python's
    names, else the OS's `comm`): sampled every 20 ms, since threads end before the region does."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[str, float]] = {}
        self._base: dict[int, float] = {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(") ", 1)[1].split()
                comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            t = int(tid)
            cpu = (int(stat[11]) + int(stat[12])) / TICK
            name = names.get(t) or self._last.get(t, (f"os:{comm}", 0))[0]
            self._last[t] = (name, cpu)

    def __enter__(self) -> ThreadCpu:
        self._sample()
        self._base = {t: c for t, (_, c) in self._last.items()}
        self._th = threading.Thread(target=self._loop, daemon=True)
        self._th.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._th.join()
        self._sample()

    def by_name(self, items: int) -> dict[str, float]:
        """ms of CPU per item per thread name (threads of one name summed; numbered pool
        threads folded into one name)."""
        out: dict[str, float] = {}
        for t, (name, cpu) in self._last.items():
            key = name.rstrip("0123456789_-") or name
            out[key] = out.get(key, 0.0) + (cpu - self._base.get(t, 0.0))
        return {k: round(v * 1e3 / items, 4) for k, v in sorted(out.items()) if v > 0}


def session_side_by_side(torch, images: list[bytes], n: int, rounds: int, mixed) -> dict:
    import torchvision.io as tvio
    from bench_gpu import recipe_fn

    import nicoffload
    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import single_device_plan
    from nicoffload.runtime.gpu_stage import GpuStage

    pipeline = load_pipeline(RESNET)
    bs = pipeline.batch_max_size
    items = [images[i % len(images)] for i in range(n)]
    batches = [items[k : k + bs] for k in range(0, n, bs)]
    plan = single_device_plan(pipeline, "gpu0")
    session = nicoffload.open(pipeline, plan)
    stage = GpuStage(pipeline, plan.stages[0], {"norm"}, workers=2)
    decode, recipe = decode_only_fn(torch, tvio, False), recipe_fn(torch, tvio)

    def stage_alone() -> None:
        for b in stage.stream({"image": x} for x in batches):
            b.wait()

    def session_stream() -> None:
        for b in session.stream(items):
            assert b.ok.all()

    def session_run() -> None:
        assert session.run(items).ok.all()

    wall_methods = {"stage_alone": stage_alone, "session_stream": session_stream}
    wall_methods["session_run"] = session_run
    names = ["nvjpeg_decode_only", "recipe_torchvision", *wall_methods]
    for fn in (stage_alone, session_stream, session_run):
        fn()
    for b in batches[:2]:
        decode(b), recipe(b)
    runs: dict[str, list[dict]] = {m: [] for m in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for m in order if r % 2 == 0 else order[::-1]:
            if m in wall_methods:
                torch.cuda.synchronize()
                with ThreadCpu() as tc:
                    c0, t0 = time.process_time(), time.perf_counter()
                    wall_methods[m]()
                    torch.cuda.synchronize()
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                ips, ms = n / wall, cpu * 1e3 / n
                runs[m].append({"ips": ips, "cpu": ms, "threads": tc.by_name(n)})
            else:
                ips, ms = timed(torch, decode if m == "nvjpeg_decode_only" else recipe, batches)
                runs[m].append({"ips": ips, "cpu": ms})
    out: dict = {"items": n, "batch": bs, "rounds": rounds}
    for m, rs in runs.items():
        out[m] = {
            "items_per_s": statistics.median(x["ips"] for x in rs),
            "runs": [round(x["ips"]) for x in rs],
            "host_cpu_ms_per_item": statistics.median(x["cpu"] for x in rs),
        }
        if "threads" in rs[0]:
            out[m]["threads_ms_per_item_last_round"] = rs[-1]["threads"]
    base = runs["nvjpeg_decode_only"]
    for m in ("session_stream", "session_run", "stage_alone"):
        paired = [a["ips"] / b["ips"] for a, b in zip(runs[m], base, strict=True)]
        out[f"{m}_vs_nvjpeg_paired_median"] = statistics.median(paired)
        out[f"{m}_vs_recipe"] = out[m]["items_per_s"] / out["recipe_torchvision"]["items_per_s"]
    out["second_call_first_batch_ms"] = first_batch_ms(session, items[: 4 * bs])
    out["mixed_corpus"] = mixed_run(session, mixed)
    out["runtime_overhead_null_stage"] = runtime_overhead()
    out["decode_stats"] = vars(session.executor.gpu.stage.steps[0].fn.stats)
    session.close()
    stage.close()
    return out


def first_batch_ms(session, items: list[bytes], calls: int = 10) -> list[float]:
    """Per call after the first: ms from asking for the stream to holding its first batch."""
    session.run(items)
    got = []
    for _ in range(calls):
        t0 = time.perf_counter()
        stream = session.stream(items)
        next(stream)
        got.append(round((time.perf_counter() - t0) * 1e3, 2))
        for _ in stream:
            pass
    return got


def mixed_run(session, mixed: list[bytes]) -> dict:
    """The sample corpus (sizes up to 1080p, some progressive) through the same session."""
    session.run(mixed[:128])
    c0, t0 = time.process_time(), time.perf_counter()
    errors = sum(len(b.failures) for b in session.stream(mixed))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "items": len(mixed),
        "items_per_s": len(mixed) / wall,
        "host_cpu_ms_per_item": cpu * 1e3 / len(mixed),
        "errors": errors,
    }


def decoders(torch, images: list[bytes], sizes, n: int = 4096, reps: int = 3) -> dict:
    """nvImageCodec's backends alone, torchvision's nvJPEG alone, and both at once (nvImageCodec's
    hardware engines on a share of each batch in one thread, nvJPEG on the rest in another)."""
    import torchvision.io as tvio

    try:
        from nvidia import nvimgcodec
    except Exception as exc:
        return {"error": repr(exc)}
    kinds = nvimgcodec.BackendKind
    backends = {
        "hw": [nvimgcodec.Backend(kinds.HW_GPU_ONLY)],
        "cuda": [nvimgcodec.Backend(kinds.GPU_ONLY)],
        "hybrid": [nvimgcodec.Backend(kinds.HYBRID_CPU_GPU)],
        "hw+cuda": [nvimgcodec.Backend(kinds.HW_GPU_ONLY), nvimgcodec.Backend(kinds.GPU_ONLY)],
    }
    res: dict = {"version": getattr(nvimgcodec, "__version__", "?")}
    decs = {}
    for name, bk in backends.items():
        try:
            decs[name] = nvimgcodec.Decoder(backends=bk, max_num_cpu_threads=4)
        except Exception as exc:
            res[f"{name}_error"] = repr(exc)
    nvjpeg = decode_only_fn(torch, tvio, False)

    def nvic(dec):
        def run(batch):
            return [torch.as_tensor(im, device=CUDA0) for im in dec.decode(batch)]

        return run

    def both(dec, share: float):
        def run(batch):
            k = int(len(batch) * share)
            box: list = []
            th = threading.Thread(target=lambda: box.append(nvic(dec)(batch[:k])))
            th.start()
            rest = nvjpeg(batch[k:])
            th.join()
            return box[0] + list(rest)

        return run

    for bs in sizes:
        items = [images[i % len(images)] for i in range(n)]
        batches = [items[k : k + bs] for k in range(0, n, bs)]
        methods = {"tv_nvjpeg": nvjpeg} | {f"nvic_{k}": nvic(d) for k, d in decs.items()}
        if "hw" in decs:
            for share in (0.3, 0.5, 0.7):
                methods[f"hw{share}+tv_nvjpeg"] = both(decs["hw"], share)
        row: dict = {}
        for m, fn in methods.items():
            try:
                fn(batches[0])
                got = [timed(torch, fn, batches) for _ in range(reps)]
            except Exception as exc:
                row[m] = {"error": repr(exc)[:300]}
                continue
            row[m] = {
                "items_per_s": max(g[0] for g in got),
                "runs": [round(g[0]) for g in got],
                "host_cpu_ms_per_item": min(g[1] for g in got),
            }
        res[f"batch{bs}"] = row
        print("decoders", bs, {m: v.get("items_per_s") for m, v in row.items()}, flush=True)
    return res


def runtime_overhead(n: int = 20000, rounds: int = 2) -> dict:
    """The host runtime's own cost around a GPU stage, without a GPU: the all-GPU plan through
    the executor with a stage that does nothing (an (n, 1) output per batch), by the batch path
    (gpu_direct) and by the general path (per-item tasks on host workers, rows collected)."""
    import numpy as np

    from nicoffload.graph import load_pipeline
    from nicoffload.inputs import values_items
    from nicoffload.planner.plan import single_device_plan
    from nicoffload.runtime.executor import Executor

    class Done:
        def __init__(self, n: int) -> None:
            self.n, self.failures, self.produced = n, {}, np.ones(n, bool)
            self.outputs = {"norm": np.zeros((n, 1), np.float16)}

    class NullStage:
        inputs, outputs, steps = ["image"], ["norm"], []

        def stream(self, batches):
            for b in batches:
                yield Done(len(b["image"]))

        def close(self) -> None:
            pass

    pipeline = load_pipeline(RESNET)
    plan = single_device_plan(pipeline, "gpu0")
    items = [b"\xff\xd8" + bytes(100)] * n
    out = {}
    for path in ("batch", "general"):
        ex = Executor(pipeline, plan, gpu_stage=NullStage())
        if path == "general":
            ex.direct = None  # what every all-GPU plan ran before gpu_direct
        for _ in range(rounds):
            c0, t0 = time.process_time(), time.perf_counter()
            got = sum(len(b) for b in ex.stream(values_items(pipeline, items)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out[path] = {"items_per_s": round(got / wall), "host_cpu_ms_per_item": cpu * 1e3 / got}
    return out


if __name__ == "__main__":  # PYTHONPATH=. python3 bench/gpu_session.py: the overhead alone
    import json
    import platform

    print(json.dumps({"machine": platform.node(), "cores": os.cpu_count()} | runtime_overhead()))
