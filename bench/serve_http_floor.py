"""What HTTP alone costs a front per request: a bare aiohttp endpoint (no Session, no batcher)
answering every infer request with a binary answer of serve's size (one 3x224x224 fp16
tensor, copied into a new body per answer as serve's is), on each event loop (`--loops`) and each way of writing the answer (`--writes`:
`joined`, a web.Response, whose headers aiohttp joins to the body on Python before 3.12.9;
`apart`, headers and body written apart, as serve's `_send_apart`); loaded closed loop by
loadgen from one process. Interleaved, `--rounds` times; CPU per request of the endpoint and
of the load process.

    python bench/serve_http_floor.py [--loops asyncio,uvloop] [--writes joined,apart]
                                     [--seconds 3] [--rounds 3] [--concurrency 8] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prediction import loadavg, typical_jpegs

from nicoffload.procstat import process_cpu_s
from nicoffload.serve import eventloop
from nicoffload.serve import loadgen as lg

ANSWER_BYTES = 3 * 224 * 224 * 2


async def endpoint(port: int, writes: str) -> None:
    """Serve on 127.0.0.1:port until killed; print "ready" once listening."""
    import asyncio

    from aiohttp import web

    from nicoffload.serve.kserve import HEADER_LENGTH
    from nicoffload.serve.server import _send_apart

    head = json.dumps({"model_name": "m", "outputs": [], "parameters": {"server_us": 1}}).encode()
    slot = memoryview(bytearray(ANSWER_BYTES))  # where a front's answer lies (shared memory)
    headers = {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}

    async def infer(request: web.Request) -> web.StreamResponse:
        await request.read()
        body = b"".join([head, slot])  # a new body per answer, as serve's assemble_response
        if writes == "apart":
            return await _send_apart(request, body, headers)
        return web.Response(body=body, headers=headers)

    app = web.Application()
    app.add_routes([web.post("/v2/models/m/infer", infer)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one(loop: str, writes: str, bodies: list, args: Any) -> dict[str, Any]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--endpoint", str(port), "--writes", writes],
        env=dict(os.environ, **{eventloop.ENV: loop}),
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        url = f"http://127.0.0.1:{port}/v2/models/m/infer"
        c = args.concurrency
        eventloop.run(lg.run_load(url, bodies, 1.0, concurrency=c), "asyncio")  # warm-up
        server0, client0 = process_cpu_s(proc.pid), time.process_time()
        results, wall = eventloop.run(
            lg.run_load(url, bodies, args.seconds, concurrency=c), "asyncio"
        )
        server1, client1 = process_cpu_s(proc.pid), time.process_time()
    finally:
        proc.kill()
        proc.wait()
    ok = sum(r.status == 200 for r in results)
    return {
        "loop": loop,
        "writes": writes,
        "ok": ok,
        "per_s": round(ok / wall),
        "endpoint_us_per_request": round((server1 - server0) / max(1, ok) * 1e6),
        "load_us_per_request": round((client1 - client0) / max(1, ok) * 1e6),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", default="asyncio,uvloop")
    ap.add_argument("--writes", default="joined,apart")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--endpoint", type=int, help=argparse.SUPPRESS)  # the endpoint's process
    args = ap.parse_args()
    if args.endpoint is not None:
        eventloop.run(endpoint(args.endpoint, args.writes))
        return
    loops = args.loops.split(",")
    for name in loops:
        eventloop.chosen(name)  # a wrong name or a missing uvloop is said before any run
    cases = list(itertools.product(loops, args.writes.split(",")))
    bodies = [lg.request_body("image", [b]) for b in typical_jpegs(8, 96, 128)]
    doc: dict[str, Any] = {"command": " ".join(sys.argv), "load_before": loadavg(), "runs": []}
    for i in range(args.rounds):
        for loop, writes in cases if i % 2 == 0 else cases[::-1]:
            run = one(loop, writes, bodies, args)
            doc["runs"].append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    doc["load_after"] = loadavg()
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    for loop, writes in cases:
        runs = [r for r in doc["runs"] if (r["loop"], r["writes"]) == (loop, writes)]
        each = sorted(r["endpoint_us_per_request"] for r in runs)
        load_ = sorted(r["load_us_per_request"] for r in runs)
        print(f"{loop:8} {writes:7} endpoint {each} us/request, load process {load_}")


if __name__ == "__main__":
    main()
