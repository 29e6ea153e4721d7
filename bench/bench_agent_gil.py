"""How much of the DPU agent's time per item is serial Python (the GIL held), per placement.

A standalone agent (`dpu_agents.server`, one worker per core of --agent-cpus, default core 1)
and this process (the host: an AgentClient that sends ImageNet-size JPEGs in batches of 64, and
a receiver that only releases what arrives; --host-cpus, default core 0), so the agent is the
bottleneck. Per placement of pipelines/resnet50.yaml
(decode+resize+crop on the agent, decode only, everything), after a warm-up:

- a timed phase: items/s, the agent process's CPU per item (/proc utime+stime), and its kernels'
  CPU per item (STATS `kernels`: thread CPU inside the bound kernel calls);
- a sampled phase: `py-spy record --gil --rate R --format raw` on the agent (py-spy keeps only
  samples of the thread holding the GIL), GIL-held ms/item = (samples / rate) / items, and the
  functions that hold it the most (self time, and the agent's own frames that lead to it).

    python bench/bench_agent_gil.py [--items 512] [--rounds 4] [--rate 500]
        [--placement split decode all] [--transport tcp|shm] [--host-cpus 0] [--agent-cpus 1]
        [--top 12] [--spy=--native] [--raw PREFIX] [--json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "pipelines" / "resnet50.yaml"
PLACEMENTS = {  # node -> device of each placement measured
    "split": {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"},
    "decode": {"decode": "dpu0", "resize": "cpu", "crop": "cpu", "norm": "cpu"},
    "all": {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "dpu0"},
}
BATCH = 64


class Sink:
    """The receiver's side: every delivery released at once, its rows counted."""

    def __init__(self, rx: Any) -> None:
        self.rx, self.rows, self.failed = rx, 0, 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from nicoffload.errors import TransportError

        with contextlib.suppress(TransportError):  # closed under it at the end
            self._drain()

    def _drain(self) -> None:
        while (d := self.rx.recv(timeout=120)) is not None:
            n, bad = len(d.meta["request_ids"]), len(d.meta.get("failed", {}))
            bad += sum(len(g[2]) for g in d.meta.get("failed_rows", []))
            self.rx.release(d)
            with self._cond:
                self.rows += n
                self.failed += bad
                self._cond.notify_all()

    def wait(self, rows: int, timeout: float = 300.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.rows >= rows, timeout):
                raise RuntimeError(f"only {self.rows} of {rows} rows came back")


def send(client: Any, sink: Sink, items: list[dict], first: int, rounds: int) -> int:
    """`rounds` passes over `items` in batches of BATCH; returns the next free id."""
    rid = first
    for _ in range(rounds):
        for i in range(0, len(items), BATCH):
            chunk = items[i : i + BATCH]
            client.submit_batch(rid, chunk)
            rid += len(chunk)
    sink.wait(rid)
    return rid


def gil_profile(path: Path, top: int) -> tuple[int, list, list, list]:
    """(GIL samples, the top functions by self samples, the top agent frames by inclusion,
    the top lines by self samples)."""
    own: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    inside: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[_short(frames[-1])] += n
        lines[_short(frames[-1], line=True)] += n
        for f in set(frames):
            if "dpu_agents/" in f or "runtime/stage.py" in f or "/ops/" in f:
                inside[_short(f)] += n
    return total, own.most_common(top), inside.most_common(top), lines.most_common(top)


def _short(frame: str, line: bool = False) -> str:
    """'fn (path/to/file.py:12)' as 'fn (file.py)' (a function's lines counted together), or
    as 'fn (file.py:12)' with `line`."""
    name, _, where = frame.partition(" (")
    if not where:
        return name
    file = Path(where.rstrip(")")).name
    return f"{name} ({file if line else file.partition(':')[0]})"


TINY = {"shorter: 256": "shorter: 16", "size: [224, 224]": "size: [8, 8]"}


def tiny(folder: Path, n: int) -> tuple[Path, list[bytes]]:
    """resnet50.yaml resizing to 16 and cropping 8x8, and n 32x24 JPEGs: kernels of a few
    microseconds, so the agent's time per item is nearly all its per-item Python."""
    import numpy as np
    import simplejpeg

    text = PIPELINE.read_text()
    for a, b in TINY.items():
        assert a in text, a
        text = text.replace(a, b)
    path = folder / "tiny.yaml"
    path.write_text(text)
    rng = np.random.default_rng(0)
    px = [rng.integers(0, 255, (24, 32, 3), np.uint8) for _ in range(n)]
    return path, [simplejpeg.encode_jpeg(p, quality=90) for p in px]


def measure(name: str, args: argparse.Namespace, images: list[bytes], token: Path) -> dict:
    from nicoffload.agent import auth
    from nicoffload.agent.client import AgentClient
    from nicoffload.agent.local import LocalAgent
    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import Plan, stages_for
    from nicoffload.procstat import tree_cpu_s
    from nicoffload.transport import listen

    pipeline = load_pipeline(args.pipeline)
    place = PLACEMENTS[name]
    stages, transfers = stages_for(pipeline, place)
    plan = Plan(pipeline.name, dict(place), stages, transfers, topology="bench")
    prefix = ["taskset", "-c", args.agent_cpus]
    items = [{"image": b} for b in images]
    cores = len(_cpus(args.agent_cpus))
    with LocalAgent(
        token, cores=cores, worker_processes=args.worker_processes, prefix=prefix
    ) as agent:
        client = AgentClient(agent.address, auth.read_token(token), timeout=60)
        where = {"shm": f"shm://bench-gil-{os.getpid()}"}.get(args.transport, "tcp://127.0.0.1:0")
        slot = BATCH * 375 * 500 * 3 + (1 << 20)  # decode only sends the full-size images
        with listen(where, slots=3, slot_bytes=slot, key=client.forward_key) as rx:
            client.load(
                args.pipeline.read_text(),
                plan,
                plan.stages[0].name,
                rx.address,
                batch_max_size=BATCH,
                batch_max_wait_ms=2,
            )
            sink = Sink(rx)
            rid = send(client, sink, items, 0, 1)  # warm: kernels, coefficient caches
            k0 = client.stats()["kernels"]
            cpu0, t0 = tree_cpu_s(agent.pid), time.perf_counter()
            rid2 = send(client, sink, items, rid, args.rounds)
            wall, cpu = time.perf_counter() - t0, tree_cpu_s(agent.pid) - cpu0
            stats = client.stats()
            timed = rid2 - rid
            kernels = _kernels_delta(k0, stats["kernels"])
            fd, out = tempfile.mkstemp(suffix=".txt")
            os.close(fd)
            spy = subprocess.Popen(
                [
                    *("taskset", "-c", args.host_cpus),
                    shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                    *("record", "--gil", "--rate", str(args.rate), "--format", "raw", *args.spy),
                    *("-p", str(agent.pid), "-o", out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(1.0)  # py-spy attached
            t1 = time.perf_counter()
            rid3 = send(client, sink, items, rid2, args.rounds)
            sampled_s = time.perf_counter() - t1
            spy.send_signal(signal.SIGINT)
            _, err = spy.communicate(timeout=60)
            samples, own, inside, lines = gil_profile(Path(out), args.top)
            if args.raw:
                shutil.move(out, f"{args.raw}.{name}.txt")
            else:
                os.unlink(out)
            sampled = rid3 - rid2
            errors = sink.failed
            client.close()
    return {
        "placement": name,
        "items": timed,
        "failed_rows": errors,
        "items_per_s": round(timed / wall, 1),
        "agent_cpu_ms_per_item": round(cpu * 1e3 / timed, 4),
        "kernel_cpu_ms_per_item": kernels,
        "gil_ms_per_item": round(samples / args.rate * 1e3 / sampled, 4),
        "gil_samples": samples,
        "sampled_items": sampled,
        "sampled_items_per_s": round(sampled / sampled_s, 1),
        "py_spy": err.strip().splitlines()[-1:] if err.strip() else [],
        "top_self": own,
        "top_agent_frames": inside,
        "top_self_lines": lines,
    }


def _cpus(spec: str) -> set[int]:
    """taskset's list ("1", "0-3", "1,3") as a set of cores."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _kernels_delta(before: dict, after: dict) -> float:
    """The kernels' CPU ms per item over the timed phase (STATS keeps running means)."""
    (stage,) = after
    a, b = after[stage], before.get(stage, {"cpu_ms_per_item": 0.0, "items": 0})
    n = a["items"] - b["items"]
    total = a["cpu_ms_per_item"] * a["items"] - b["cpu_ms_per_item"] * b["items"]
    return round(total / n, 4) if n else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--placement", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--host-cpus", default="0", help="this process's cores (taskset list)")
    ap.add_argument("--agent-cpus", default="1", help="the agent's cores: one worker each")
    ap.add_argument(
        "--worker-processes", choices=("auto", "on", "off"), help="the agent's (default: auto)"
    )
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--spy", nargs="*", default=[], help="more py-spy record flags (--native)")
    ap.add_argument("--tiny", action="store_true", help="32x24 JPEGs, resize 16, crop 8 (`tiny`)")
    ap.add_argument("--raw", help="keep py-spy's raw samples as RAW.<placement>.txt")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    host, agent = _cpus(args.host_cpus), _cpus(args.agent_cpus)
    if not (host | agent) <= os.sched_getaffinity(0) or host & agent or not shutil.which("taskset"):
        sys.exit("needs taskset and the cores of --host-cpus and --agent-cpus, apart")
    os.sched_setaffinity(0, host)  # before any thread: they all inherit it
    from bench_prediction import typical_jpegs

    with tempfile.TemporaryDirectory() as tmp:
        from nicoffload.agent import auth

        if args.tiny:
            args.pipeline, images = tiny(Path(tmp), args.items)
        else:
            args.pipeline, images = PIPELINE, typical_jpegs(args.items, 375, 500)
        token = Path(tmp) / "token"
        auth.write_token(token)
        results = [measure(p, args, images, token) for p in args.placement]
    doc = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "pipeline": str(args.pipeline.name),
        "results": results,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    for r in results:
        print(
            f"{r['placement']:>7}: {r['items_per_s']:8.1f} items/s  GIL {r['gil_ms_per_item']:.3f}"
            f" ms/item  agent CPU {r['agent_cpu_ms_per_item']:.3f} ms/item  kernels "
            f"{r['kernel_cpu_ms_per_item']:.3f} ms/item  ({r['items']} items, "
            f"{r['failed_rows']} failed; sampled {r['sampled_items_per_s']} items/s)"
        )
        for label, rows in (
            ("self", r["top_self"]),
            ("self, line by line", r["top_self_lines"]),
            ("agent frames", r["top_agent_frames"]),
        ):
            print(f"    GIL held, by {label} (ms/item):")
            for fn, n in rows:
                print(f"      {n / args.rate * 1e3 / r['sampled_items']:7.4f}  {fn}")


if __name__ == "__main__":
    main()
