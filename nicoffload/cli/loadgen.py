"""`nicoffload loadgen`: load an inference endpoint, open or closed loop, and report."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from nicoffload.cli import app, emit_json, handle_errors
from nicoffload.errors import Mark, SystemFailure, UserError


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(r <= 0 for r in rates):
        raise UserError(
            f"--rate '{text}': give requests per second > 0, or a comma list (50,100,200)"
        )
    return rates


def input_name(url: str, token: str | None) -> str:
    """The endpoint's one BYTES input, from its model metadata (the URL without /infer)."""
    if not url.rstrip("/").endswith("/infer"):
        raise UserError(
            f"URL '{url}': give the inference URL `serve` prints (…/v2/models/NAME/infer)"
        )
    meta_url = url.rstrip("/")[: -len("/infer")]
    req = urllib.request.Request(
        meta_url, headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            meta = json.load(resp)
    except OSError as exc:
        raise SystemFailure(
            f"loadgen: cannot read the model's metadata at {meta_url}: {exc}"
        ) from None
    inputs = meta.get("inputs") or []
    if len(inputs) != 1 or inputs[0].get("datatype") != "BYTES":
        raise UserError(f"loadgen sends one BYTES input; the model has {inputs}")
    return str(inputs[0]["name"])


def load_items(images: Path | None, sample: int | None, seed: int) -> list[bytes]:
    if (images is None) == (sample is None):
        raise UserError("give exactly one of --images DIR or --sample N")
    if sample is not None:
        from nicoffload.samples import sample_images

        return [b for _, b in sample_images(sample, seed)]
    assert images is not None
    if not images.is_dir():
        raise UserError(f"--images: '{images}' is not a folder", Mark(str(images), 1, 1))
    files = sorted(p for p in images.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise UserError(f"--images: no files in '{images}'", Mark(str(images), 1, 1))
    return [p.read_bytes() for p in files]


def table(doc: dict[str, Any]) -> Table:
    t = Table(title=f"nicoffload loadgen {doc['url']}", title_justify="left")
    for col in (
        "offered/s",
        "sent",
        "ok",
        "goodput/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "p99.9 ms",
        "errors",
    ):
        t.add_column(col, justify="right")
    for r in doc["runs"]:
        lat = r["latency_ms"]
        t.add_row(
            "closed" if r["offered_per_s"] is None else f"{r['offered_per_s']:g}",
            str(r["sent"]),
            str(r["ok"]),
            f"{r['goodput_per_s']:.1f}",
            *("-" if lat[k] is None else f"{lat[k]:.2f}" for k in ("p50", "p90", "p99", "p99.9")),
            ", ".join(f"{k}: {v}" for k, v in r["errors_by_status"].items()) or "-",
        )
    return t


@app.command()
@handle_errors
def loadgen(
    url: str = typer.Argument(..., help="the inference URL `nicoffload serve` printed"),
    rate: str | None = typer.Option(
        None, "--rate", help="open loop: Poisson arrivals at R requests/s; a comma list sweeps"
    ),
    duration: float = typer.Option(10.0, "--duration", min=0.01, help="seconds per run"),
    concurrency: int | None = typer.Option(
        None, "--concurrency", min=1, help="closed loop (without --rate): C clients back to back"
    ),
    images: Path | None = typer.Option(None, "--images", help="a folder of files: one per request"),
    sample: int | None = typer.Option(None, "--sample", min=1, help="N generated JPEGs instead"),
    token_file: Path | None = typer.Option(None, "--token-file", help="the server's bearer token"),
    seed: int = typer.Option(0, "--seed", help="seed of the arrivals and of --sample"),
    procs: int = typer.Option(
        1,
        "--procs",
        min=1,
        max=256,
        help="load processes: open loop, P Poisson streams of R/P (one stream of R together); "
        "closed loop, the C clients dealt out; percentiles over every request's latency",
    ),
    grpc_at: str | None = typer.Option(
        None,
        "--grpc",
        help="send the requests over KServe v2 gRPC to HOST:PORT (the `grpc` address `serve "
        "--grpc` printed) instead of HTTP; the URL still names the model (extra 'grpc')",
    ),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
    plot_file: Path | None = typer.Option(
        None,
        "--plot",
        help="draw latency against load and the stacked breakdown (PNG; extra 'plot')",
    ),
) -> None:
    """Load an Open Inference Protocol endpoint with one item per request and report goodput, latency percentiles (p50/p90/p99/p99.9), errors by HTTP status, and the mean per-request breakdown (the client's and the server's measured parts, which sum to the end-to-end latency on one kernel; the same for the slowest 1%).

    Open loop: `--rate 100` (or `--rate 50,100,200` to sweep); a request's latency counts from when it was due. Closed loop: `--concurrency 4` without --rate.

    One Python process offers about 1,500-2,000 requests/s over HTTP: `--procs P` spreads the load over P processes (P Poisson streams of R/P, or the clients dealt out) and merges every request's result, so the percentiles are of all the latencies. `--grpc HOST:PORT` loads serve's gRPC endpoint instead (the URL still names the model and its input).
    """
    from nicoffload.cli.serve import read_token
    from nicoffload.serve import loadgen as lg

    if rate is None and concurrency is None:
        raise UserError("give --rate R (open loop) or --concurrency C (closed loop)")
    if rate is not None and concurrency is not None:
        raise UserError("--concurrency is the closed loop: give it without --rate")
    rates: list[float | None] = list(parse_rates(rate)) if rate is not None else [None]
    token = read_token(token_file) if token_file is not None else None
    items = load_items(images, sample, seed)
    grpc_addr = None
    if grpc_at is not None:  # a bad address is said before anything is sent
        from nicoffload.cli.serve import parse_listen

        grpc_addr = parse_listen(grpc_at, "--grpc")
    name = input_name(url, token)
    target = url
    if grpc_addr is not None:
        host, port = grpc_addr
        model = url.rstrip("/").split("/")[-2]  # …/v2/models/NAME/infer
        target = f"{lg.GRPC}{host if ':' not in host else f'[{host}]'}:{port}"
        bodies: list[Any] = [lg.grpc_request_body(model, name, [b]) for b in items]
    else:
        bodies = [lg.request_body(name, [b]) for b in items]
    from nicoffload.serve import eventloop

    loop = eventloop.chosen()  # as loadgen's processes
    runs = []
    workers = lg.pool(procs) if procs > 1 else None
    try:
        for r in rates:
            if workers is None:
                results, wall = eventloop.run(
                    lg.run_load(target, bodies, duration, r, concurrency, token, seed), loop
                )
                used = 1
            else:
                results, wall, _, used = lg.run_procs(
                    workers, procs, target, bodies, duration, r, concurrency, token, seed
                )
            runs.append(
                lg.summarize(results, wall, r)
                | ({"concurrency": concurrency} if r is None else {})
                | {"procs": used}
            )
    finally:
        if workers is not None:
            workers.shutdown()
    doc = {
        "url": url,
        "protocol": "grpc" if grpc_at is not None else "http",
        "target": target,
        "mode": "open" if rate is not None else "closed",
        "procs": procs,
        "event_loop": loop,
        "runs": runs,
    }
    if plot_file is not None:
        lg.plot(runs, str(plot_file))
    if json_out:
        emit_json(doc)
    else:
        Console().print(table(doc))
        for r in runs:
            at = r["offered_per_s"] or "closed loop"
            parts = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r["breakdown_ms"].items())
            Console().print(f"mean breakdown (ms) at {at}: {parts}")
            if r.get("tail_breakdown_ms"):
                slow = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r["tail_breakdown_ms"].items())
                Console().print(f"  the slowest 1% (mean {r['tail_latency_mean_ms']:.2f}): {slow}")
