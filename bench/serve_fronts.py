"""bench_serve's `--fronts` sweep (issue #19's H200 target): for each plan, `serve --fronts F`
for each F, loaded open loop at fixed rates (`--rates`) from each count of load processes
(`--loadgen-procs`), each sweep stopping at the first rate the server does not keep up with;
beside it, in the same run, the Session's own batch throughput on the same plan and JPEGs
(`stream`, no serving), which the target compares against: the best goodput with p99 <= 20 ms
over that throughput, >= 0.8 wanted.

Host CPU per request: serve's process (the Session, the batcher, the fronts' readers), its
fronts and its agents, over each run's answered requests; the load processes' apart. serve's
also by thread, and less the runtime's host workers (`serve_overhead_ms_per_request`, the
table's `s-over`: what serving costs that process besides the kernels run on the host; with
GPU stages their threads are in it). The fronts' stats say how the requests were grouped
(`requests` over `request_groups`: the mean group a front sent).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from serve_load import KEPT_UP, Serve, Target, load

import nicoffload
from nicoffload.serve import loadgen as lg

P99_MS = 20.0
WORKERS = "nicoffload-work"  # the runtime's host worker threads, by kernel name (15 bytes)
WANTED = 0.8


def session_throughput(pipeline: Any, plan: Any, topology: Any, images: list[bytes]) -> dict:
    """The Session's `stream` on `plan` (each batch read in place, as serve's batcher does):
    items/s and this process's CPU ms per item over 3 rounds of 4,096 items, after a warm-up."""
    corpus = [images[i % len(images)] for i in range(4096)]
    with nicoffload.open(pipeline, plan, topology) as session:
        for batch in session.stream(corpus[:512]):
            assert batch.ok.all(), [f.reason for f in batch.failures]
        cpu, t0 = time.process_time(), time.perf_counter()
        for _ in range(3):
            for batch in session.stream(corpus):
                assert batch.ok.all(), [f.reason for f in batch.failures]
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
        # where stream leaves the outputs: GPU outputs are not copied to the host here, as
        # serve must copy them to answer
        on_gpu = any(getattr(v, "is_cuda", False) for v in batch.outputs.values())
    items = 3 * len(corpus)
    return {
        "stream_items_per_s": round(items / wall, 1),
        "host_cpu_ms_per_item": round(cpu * 1e3 / items, 4),
        "outputs_on": "gpu" if on_gpu else "host",
    }


def _kept_up(run: dict, seconds: float, kept_up: float) -> bool:
    return not run["errors_by_status"] and run["duration_s"] <= seconds / kept_up


def sweep(serve: Serve, target: Target, args: Any) -> dict[str, Any]:
    """One server, one load-process count: the rates in turn until one is not kept up."""
    load(target, 1.5, rate=min(args.rates))  # warm-up: connections, the first batches
    runs = []
    for rate in args.rates:
        print(f"   {rate:g}/s ...", file=sys.stderr, flush=True)
        (core0, agents0), each0, threads0 = serve.cpu(), serve.fronts_cpu_each(), serve.threads()
        r = load(target, args.open_s, rate=rate)
        (core1, agents1), each1, threads1 = serve.cpu(), serve.fronts_cpu_each(), serve.threads()
        fronts0, fronts1 = sum(each0), sum(each1)
        # each front's CPU s over the run: how evenly the one listener spread the connections
        r["fronts_cpu_s_each"] = [round(b - a, 3) for a, b in zip(each0, each1, strict=True)]
        ok = max(1, r["ok"])
        r["serve_cpu_ms_per_request"] = round((core1 - core0) / ok * 1e3, 4)
        r["fronts_cpu_ms_per_request"] = round((fronts1 - fronts0) / ok * 1e3, 4)
        r["agent_cpu_ms_per_request"] = round((agents1 - agents0) / ok * 1e3, 4)
        by_thread = {
            k: round((v - threads0.get(k, 0.0)) / ok * 1e3, 4) for k, v in threads1.items()
        }
        r["serve_cpu_ms_per_request_by_thread"] = {k: v for k, v in by_thread.items() if v}
        # serve's process less its kernels (the runtime's host workers): what serving a
        # request costs it, the fronts' readers, the batcher, the runtime's feeder and reader
        r["serve_overhead_ms_per_request"] = round(
            sum(v for k, v in by_thread.items() if not k.startswith(WORKERS)), 4
        )
        r["host_cpu_ms_per_request"] = round(
            r["serve_cpu_ms_per_request"]
            + r["fronts_cpu_ms_per_request"]
            + r["agent_cpu_ms_per_request"],
            4,
        )
        r["kept_up"] = _kept_up(r, args.open_s, KEPT_UP)
        runs.append(r)
        if not r["kept_up"]:
            break
    within = [
        r["goodput_per_s"]
        for r in runs
        if not r["errors_by_status"] and (r["latency_ms"]["p99"] or 1e9) <= P99_MS
    ]
    kept = [r["offered_per_s"] for r in runs if r["kept_up"]]
    return {
        "best_goodput_p99_within_20ms_per_s": max(within, default=None),
        "saturation_per_s": max(kept, default=0.0),
        "runs": runs,
    }


def measure(plan: Any, images: list[bytes], args: Any, folder: Path, slug: str) -> dict[str, Any]:
    """Every --fronts count x every --loadgen-procs count on `plan` (HTTP)."""
    plan.save(folder / f"{slug}.json")
    out: dict[str, Any] = {}
    for fronts in args.fronts:
        print(f"  --fronts {fronts} ...", file=sys.stderr, flush=True)
        more = ("--fronts", str(fronts), "--max-queue", str(args.max_queue))
        more += ("--front-slots", str(args.front_slots))
        log = folder / f"{slug}-fronts{fronts}.log"
        try:
            s = Serve(folder / f"{slug}.json", log, more=more)
        except SystemExit as exc:  # this count did not start (/dev/shm too small?): the next
            print(f"  --fronts {fronts}: {exc}", file=sys.stderr, flush=True)
            out[str(fronts)] = {
                "error": str(exc)[-2000:],
                "best_goodput_p99_within_20ms_per_s": None,
            }
            continue
        row: dict[str, Any] = {"front_pids": s.fronts, "by_procs": {}}
        try:
            bodies = [lg.request_body("image", [b]) for b in images]
            for procs in args.loadgen_procs:
                print(f"  loadgen procs {procs} ...", file=sys.stderr, flush=True)
                pool = lg.pool(procs)
                try:
                    t = Target(s.doc["url"], bodies, pool, procs)
                    row["by_procs"][str(procs)] = sweep(s, t, args)
                except Exception as exc:  # recorded: the other counts still run
                    row["by_procs"][str(procs)] = {
                        "error": f"{type(exc).__name__}: {exc}"[:2000],
                        "best_goodput_p99_within_20ms_per_s": None,
                    }
                finally:
                    pool.shutdown()
        finally:
            row["serve_exit"] = s.stop()
        stats = [x for x in log.read_text().splitlines() if "nicoffload.serve: fronts: " in x]
        row["fronts_stats"] = stats[-1].split("fronts: ", 1)[1] if stats else None
        best = [
            v["best_goodput_p99_within_20ms_per_s"]
            for v in row["by_procs"].values()
            if v["best_goodput_p99_within_20ms_per_s"]
        ]
        row["best_goodput_p99_within_20ms_per_s"] = max(best, default=None)
        row["ready_line"] = {k: v for k, v in s.doc.items() if k not in ("predicted",)}
        out[str(fronts)] = row
        if args.out:  # what is done so far, should the run be cut short
            (args.out / f"{slug}-partial.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def ratios(by_fronts: dict[str, Any], session: dict[str, Any]) -> dict[str, float | None]:
    """Each front count's best goodput (p99 <= 20 ms) over the Session's stream items/s."""
    base = session["stream_items_per_s"]
    return {
        f: None
        if r["best_goodput_p99_within_20ms_per_s"] is None
        else round(r["best_goodput_p99_within_20ms_per_s"] / base, 3)
        for f, r in by_fronts.items()
    }


def table(doc: dict[str, Any]) -> list[str]:
    lines = []
    for name, row in doc["plans"].items():
        sess = row["session"]
        lines.append(
            f"{name}: the Session's stream {sess['stream_items_per_s']:.0f} items/s "
            f"({sess['host_cpu_ms_per_item']:.3f} ms CPU/item); ratio wanted >= {WANTED}"
        )
        lines.append(
            f"{'fronts':>6} {'procs':>5} {'offered':>8} {'goodput':>8} {'p50':>7} {'p99':>7} "
            f"{'host ms/req':>11} {'serve':>6} {'s-over':>6} {'fronts':>6} {'client':>6} errors"
        )
        for f, fr in row["by_fronts"].items():
            if "error" in fr:
                lines.append(f"{f:>6} did not start: {fr['error'][-300:]}")
            for p, sw in fr.get("by_procs", {}).items():
                if "error" in sw:
                    lines.append(f"{f:>6} {p:>5} failed: {sw['error']}")
                for r in sw["runs"]:
                    lat = r["latency_ms"]
                    lines.append(
                        f"{f:>6} {p:>5} {r['offered_per_s']:>8.0f} {r['goodput_per_s']:>8.0f} "
                        f"{lat['p50'] or 0:>7.2f} {lat['p99'] or 0:>7.2f} "
                        f"{r['host_cpu_ms_per_request']:>11.3f} "
                        f"{r['serve_cpu_ms_per_request']:>6.3f} "
                        f"{r.get('serve_overhead_ms_per_request', 0):>6.3f} "
                        f"{r['fronts_cpu_ms_per_request']:>6.3f} "
                        f"{r['client_cpu_ms_per_request']:>6.3f} {r['errors_by_status'] or ''}"
                    )
        lines.append(f"best goodput (p99 <= 20 ms) / the Session's: {row['ratio']}")
    return lines
