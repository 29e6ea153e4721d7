"""`nicoffload serve`: open a Session and serve it over the Open Inference Protocol (HTTP, and
gRPC with --grpc)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import typer

from nicoffload.cli import app, handle_errors, ray_options
from nicoffload.cli.run import check_token_file
from nicoffload.errors import Mark, SystemFailure, UserError
from nicoffload.graph import Pipeline, load_pipeline

log = logging.getLogger("nicoffload.serve")


def parse_listen(text: str, option: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UserError(f"{option} '{text}': give HOST:PORT (PORT 0 picks a free one)")
    return host.strip("[]") or "127.0.0.1", int(port)


def read_token(path: Path) -> str:
    check_token_file(path)
    token = path.read_text(encoding="utf-8", errors="strict").strip()
    if not token:
        raise UserError("--token-file: the file is empty", Mark(str(path), 1, 1))
    return token


def load_model(ref: str) -> Any:
    """`MODULE:CALLABLE` imported (the current folder first on the path, as `python -m`)."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise UserError(f"--model '{ref}': give MODULE:CALLABLE (e.g. mymodels:classify)")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise UserError(f"--model '{ref}': cannot import '{module}': {exc}") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise UserError(f"--model '{ref}': '{module}' has no callable '{attr}'")
    return fn


def check_servable(pipeline: Pipeline) -> None:
    """Responses are tensors of rows: every output must have one shape for all items."""
    for name, spec in pipeline.output_specs().items():
        if not spec.static:
            raise UserError(
                f"output '{name}' is {spec}, which varies per item; serve needs outputs of one "
                "shape (end the pipeline with a node of fixed size, such as center_crop)",
                Mark(pipeline.path, 1, 1),
            )


def model_outputs(model: Any, pipeline: Pipeline) -> list[dict[str, Any]]:
    """The model's outputs as metadata, from one warm-up call on an all-zeros row."""
    from nicoffload.serve.kserve import datatype_of

    row = {k: np.zeros((1, *s.shape), s.dtype) for k, s in pipeline.output_specs().items()}
    try:
        got = model(row)
        out = [
            {
                "name": str(k),
                "datatype": datatype_of(np.asarray(v).dtype),
                "shape": [-1, *np.asarray(v).shape[1:]],
            }
            for k, v in dict(got).items()
        ]
    except Exception as exc:
        raise UserError(
            f"--model: the warm-up call on one all-zeros row of {sorted(row)} failed: "
            f"{type(exc).__name__}: {exc} (the model takes a dict of arrays and returns one)"
        ) from None
    return out


def grpc_module() -> Any:
    """nicoffload.serve.grpc_server, or the extra to install (grpcio, tritonclient[grpc])."""
    try:
        from nicoffload.serve import grpc_server
    except ImportError as exc:
        from nicoffload.errors import MissingDependency

        raise MissingDependency(exc.name or "grpcio", "grpc", "serve --grpc") from exc
    return grpc_server


async def _serve(
    server: Any,
    batcher: Any,
    listen: tuple[str, int],
    grpc_listen: tuple[str, int] | None,
    ready_doc: dict[str, Any],
) -> None:
    from aiohttp import web

    from nicoffload.serve.threads import name_os_threads

    host, port = listen

    runner = web.AppRunner(server.app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise UserError(f"--listen {host}:{port}: {exc.strerror or exc}") from None
    bound = runner.addresses[0]
    base = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
    name = server.config.model_name
    doc = {
        "url": f"{base}/v2/models/{name}/infer",
        "model": name,
        "health": f"{base}/v2/health/ready",
    }
    grpc_server = None
    if grpc_listen is not None:
        ghost, gport = grpc_listen
        try:
            grpc_server, gbound = await grpc_module().start(server, ghost, gport)
        except OSError as exc:
            await runner.cleanup()
            raise UserError(f"--grpc {ghost}:{gport}: {exc}") from None
        doc["grpc"] = f"{ghost if ':' not in ghost else f'[{ghost}]'}:{gbound}"
    doc.update(ready_doc)
    # the drain's handler is in place before the ready line: a SIGTERM that follows the line
    # at once drains (it unwound the process, exit 143, in the window between the two)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)  # `handle_errors`' (SIGTERM unwinds)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    name_os_threads()  # the event loop, batcher and workers by name in top -H and /proc
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()

    async def stream_ended() -> None:  # the pipeline failed: stop serving (exit 1 below)
        polls = 0
        while not batcher.ended.is_set():
            await asyncio.sleep(0.2)
            polls += 1
            if polls % 25 == 0:  # threads started since (the executor's for large requests)
                name_os_threads()

    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(stream_ended())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        log.info("SIGTERM: draining" if stop.is_set() else "the pipeline stopped: draining")
        await server.drain()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
        if grpc_server is not None:
            await grpc_server.stop(None)
        await runner.cleanup()


def _base(host: str, port: int) -> str:
    return f"http://{host if ':' not in host else f'[{host}]'}:{port}"


def output_bytes_per_item(pipeline: Pipeline, outputs: list[dict[str, Any]] | None) -> int:
    """One item's response bytes (the model's outputs, or the pipeline's): a front's slot."""
    from nicoffload.serve.kserve import DATATYPES

    if outputs is None:
        return sum(
            int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
            for s in pipeline.output_specs().values()
        )
    total = 0
    for o in outputs:
        dt = DATATYPES.get(o["datatype"])
        total += int(np.prod([abs(d) for d in o["shape"][1:]])) * (dt.itemsize if dt else 0)
    return total


async def _serve_fronts(fronts: Any, batcher: Any, host: str, ready_doc: dict[str, Any]) -> None:
    """serve --fronts N: the fronts started, the ready line, then SIGTERM (or the pipeline's
    end, or fronts dying past their restarts) drains them all."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    restarts: asyncio.Queue[int] = asyncio.Queue()
    fronts.on_exit = lambda i: loop.call_soon_threadsafe(restarts.put_nowait, i)
    previous = signal.getsignal(signal.SIGTERM)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        fronts.start()
    except (OSError, RuntimeError) as exc:
        raise SystemFailure(f"serve --fronts: {exc}") from None
    from nicoffload.serve.threads import name_os_threads

    name_os_threads()
    base = _base(host, fronts.port)
    name = ready_doc.pop("model")
    doc = {
        "url": f"{base}/v2/models/{name}/infer",
        "model": name,
        "health": f"{base}/v2/health/ready",
    }
    grpc_host = ready_doc.pop("grpc_host")
    if fronts.grpc_port is not None:
        doc["grpc"] = (
            f"{grpc_host if ':' not in grpc_host else f'[{grpc_host}]'}:{fronts.grpc_port}"
        )
    doc |= ready_doc | {
        "fronts": fronts.n,
        "front_pids": fronts.pids(),
        "event_loop": fronts.event_loop,  # the fronts' (they serve the HTTP)
    }
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()

    async def watch() -> None:  # a front's restart, on this thread (its PDEATHSIG's)
        while fronts.failure is None and not batcher.ended.is_set():
            try:
                i = await asyncio.wait_for(restarts.get(), 0.2)
            except TimeoutError:
                continue
            fronts.restart(i)

    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(watch())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        why = "SIGTERM" if stop.is_set() else fronts.failure or "the pipeline stopped"
        log.info("%s: draining %d fronts", why, fronts.n)
        await loop.run_in_executor(None, fronts.drain, 60.0)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)


def _fronts(
    batcher: Any,
    path: Path,
    pl: Pipeline,
    config: Any,
    outputs: list[dict[str, Any]] | None,
    max_queue: int,
    slots: int,
    n: int,
    listen: tuple[str, int],
    grpc_at: tuple[str, int] | None,
) -> Any:
    from nicoffload.errors import TransportError
    from nicoffload.serve import frontwire
    from nicoffload.serve.fronts import Fronts

    cfg = {
        "pipeline": str(path.resolve()),
        "config": dataclasses.asdict(config),
        "outputs": outputs,
        "max_queue": max_queue,
        "switch_interval_s": sys.getswitchinterval(),
    }
    slot_bytes = frontwire.slot_bytes_for(output_bytes_per_item(pl, outputs))
    try:
        return Fronts(batcher, cfg, n, listen, grpc_at, slots, slot_bytes)
    except OSError as exc:
        raise UserError(f"--listen/--grpc {listen[0]}:{listen[1]}: {exc.strerror or exc}") from None
    except TransportError as exc:
        raise SystemFailure(f"serve --fronts: {exc}") from None


@app.command()
@handle_errors
def serve(
    pipeline: Path = typer.Argument(..., help="the pipeline YAML file"),
    plan: Path | None = typer.Option(None, "--plan", help="a plan from `nicoffload plan --output`"),
    topology: Path | None = typer.Option(
        None, "--topology", help="plan for this topology (default: this machine, as `run`)"
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="MODULE:CALLABLE called on each finished batch: dict of output arrays (rows = "
        "items) -> dict of arrays; without it the preprocessed tensors are the response",
    ),
    listen: str = typer.Option("127.0.0.1:8000", "--listen", help="HOST:PORT (port 0: any free)"),
    grpc_listen: str | None = typer.Option(
        None,
        "--grpc",
        help="also serve KServe v2 gRPC (GRPCInferenceService) on HOST:PORT (port 0: any free); "
        "needs the extra 'grpc': pip install 'nicoffload\\[grpc]'",
    ),
    token_file: Path | None = typer.Option(
        None, "--token-file", help="clients must send `Authorization: Bearer <its content>`"
    ),
    agent_token_file: Path | None = typer.Option(
        None, "--agent-token-file", help="the shared secret of the DPU agents the topology names"
    ),
    max_queue: int = typer.Option(
        256, "--max-queue", min=1, help="items accepted and not yet answered; past it: HTTP 503"
    ),
    max_request_mb: float = typer.Option(
        64.0, "--max-request-mb", min=0.001, help="largest request body; past it: HTTP 413"
    ),
    read_timeout: float = typer.Option(
        30.0, "--read-timeout", min=0.001, help="seconds for a request body to arrive (else 408)"
    ),
    model_name: str | None = typer.Option(
        None, "--model-name", help="the model's name in URLs (default: the pipeline's name)"
    ),
    workers: int | None = typer.Option(None, "--workers", min=1, help="host worker threads"),
    max_batch: int | None = typer.Option(
        None,
        "--max-batch",
        min=1,
        help="at most this many items per batch (default: the pipeline's batch max_size)",
    ),
    wait_batches: bool = typer.Option(
        False,
        "--wait-batches",
        help="hold each batch open for the pipeline's max wait even when idle (by default a "
        "batch goes as soon as nothing waits behind it and nothing is in flight downstream)",
    ),
    n_fronts: int = typer.Option(
        1,
        "--fronts",
        min=1,
        max=64,
        help="front processes that parse requests and encode responses, all accepting on the "
        "--listen port (and --grpc's); the Session stays in this process, fed through shared "
        "memory. 1: one process does it all",
    ),
    front_slots: int = typer.Option(
        24,
        "--front-slots",
        min=1,
        help="with --fronts: each front's shared-memory slots (requests in flight that travel "
        "through shared memory; more go inline over its control socket, counted)",
    ),
    switch_us: int = typer.Option(
        500,
        "--switch-interval-us",
        min=50,
        help="the interpreter's thread switch interval (Python's default is 5000)",
    ),
    ray: str | None = typer.Option(None, "--ray", help=ray_options.RAY_HELP),
    ray_network: Path | None = typer.Option(None, "--ray-network", help=ray_options.NETWORK_HELP),
    ray_server: str | None = typer.Option(None, "--ray-server", help=ray_options.SERVER_HELP),
) -> None:
    """Serve a pipeline over the Open Inference Protocol (KServe v2 REST with Triton's binary tensors), so Triton and KServe clients work: `POST /v2/models/NAME/infer` with one BYTES input per pipeline input, one element per item (a JPEG, a text).

    With `--grpc HOST:PORT` the same model is also served over KServe v2 gRPC (Triton's gRPC clients work), same token (`authorization: Bearer` metadata), batcher, deadlines and drain; it needs `pip install 'nicoffload\\[grpc]'`.

    When ready it prints ONE JSON line on stdout (`url`, `model`, `health`, `grpc` with --grpc, `placement`, `transports` (what each DPU stage's outputs move over: the plan's physical scheme, tcp, shm or rdma), `predicted`); logs go to stderr.

    SIGTERM drains: readiness goes false, new requests get 503, requests in flight are answered, then the process exits 0.

    With `--fronts N`, N front processes accept on the same port(s), parse and check the requests and encode the responses; the Session stays in this process, fed through shared memory (`--front-slots` per front). Every behaviour above holds across them (one queue, one drain); a front that dies is restarted, its in-flight requests counted as lost.

    Deadlines: Triton's `timeout` request parameter or the `Nicoffload-Timeout-Us` header (microseconds); an item whose deadline passed before it enters the pipeline is not run (HTTP 504).

    With `--ray ADDRESS` the pipeline is planned for a server of that Ray cluster (as `plan --ray`) and its DPU stages' agents are started there as Ray actors (or attached to, with `--agent-token-file`) for as long as serve runs; an agent that dies fails its stage over to this host.
    """
    # our own log at INFO; other libraries' (torch, aiohttp) at WARNING
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    logging.getLogger("nicoffload").setLevel(logging.INFO)
    from nicoffload.planner import physical
    from nicoffload.runner import prepare
    from nicoffload.serve.batcher import Batcher
    from nicoffload.serve.server import ServeConfig, Server
    from nicoffload.session import Session

    host, port = parse_listen(listen)
    grpc_at = parse_listen(grpc_listen, "--grpc") if grpc_listen is not None else None
    if grpc_at is not None:
        grpc_module()  # a missing extra is said before the Session opens
    token = read_token(token_file) if token_file is not None else None
    check_token_file(agent_token_file)
    ray_options.check(ray, {"--topology": topology, "--ray-network": ray_network,
                            "--ray-server": ray_server})  # fmt: skip
    pl = load_pipeline(pipeline)
    check_servable(pl)
    if max_batch is not None and max_batch < pl.batch_max_size:
        pl = dataclasses.replace(pl, batch_max_size=max_batch)
    fn = load_model(model) if model else None
    outputs = model_outputs(fn, pl) if fn is not None else None
    found = None if ray is None else ray_options.discovered(ray, ray_network, ray_server)
    prep = prepare(pl, plan, found.topology if found else topology, agent_token_file)
    config = ServeConfig(
        model_name or pl.name, token, int(max_request_mb * (1 << 20)), read_timeout
    )
    # serve's threads (event loop, encoder, batcher, the runtime's feeder and workers) hand
    # the GIL to one another per request: at the default 5 ms switch interval, a thread
    # woken by another can wait that long for it while one that computes holds it
    sys.setswitchinterval(switch_us / 1e6)
    with (
        ray_options.agents_for(ray, found, prep, agent_token_file) as prep,
        Session(prep, workers=workers) as session,
    ):
        if hasattr(session.executor, "close_when_idle"):  # the general executor has no such
            session.executor.close_when_idle = not wait_batches
        batcher = Batcher(session, fn, max_queue)
        # what setting up made (the kernels' compiled code, the plan, the modules) lives as
        # long as the server: out of the collector's reach, a full collection under load
        # walks only what requests make, not the whole heap
        gc.collect()
        gc.freeze()
        server = Server(pl, batcher, config, outputs)
        batcher.start()
        ready = {
            "placement": dict(session.plan.placement),
            "stages": {s.name: s.device for s in session.plan.stages},
            # what each DPU stage's outputs move over (the plan's physical scheme, as the
            # runtime read it)
            "transports": {
                k: v["scheme"]
                for k, v in physical.complete(
                    prep.pipeline, prep.plan, prep.topology
                ).physical.items()
            },
            "predicted": None if session.plan.predicted is None else vars(session.plan.predicted),
            "setup_s": round(session.setup_s, 3),
            "max_queue": max_queue,
            "max_batch": pl.batch_max_size,
            "close_when_idle": bool(getattr(session.executor, "close_when_idle", False)),
            "switch_interval_us": round(sys.getswitchinterval() * 1e6),
            "gc_frozen": gc.get_freeze_count(),
            "auth": "bearer" if token else "none",
        }
        from nicoffload.serve import eventloop

        fronts = None
        try:
            if n_fronts == 1:
                ready["event_loop"] = eventloop.chosen()
                eventloop.run(_serve(server, batcher, (host, port), grpc_at, ready))
            else:
                fronts = _fronts(
                    batcher,
                    pipeline,
                    pl,
                    config,
                    outputs,
                    max_queue,
                    front_slots,
                    n_fronts,
                    (host, port),
                    grpc_at,
                )
                ready |= {"model": config.model_name, "grpc_host": grpc_at and grpc_at[0]}
                eventloop.run(_serve_fronts(fronts, batcher, host, ready))
        finally:  # the stream ends before the session closes (Ctrl-C too): close waits for it
            batcher.stop(timeout=30)
            if fronts is not None:
                fronts.close()
                log.info("fronts: %s", json.dumps(fronts.stats()))
        if fronts is not None and fronts.failure is not None:
            raise SystemFailure(f"serve: {fronts.failure}")
        if batcher.failure is not None:
            raise SystemFailure(
                f"serve: the pipeline failed: {batcher.failure}"
            ) from batcher.failure
    log.info("drained: %d items run, %d never run (deadline)", batcher.items_run, batcher.expired)
    if batcher.failed_over:
        log.info("failover during the run: %s", batcher.failed_over)
