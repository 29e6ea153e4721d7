"""`nicoffload run`: stream items through a planned pipeline and report what it measured."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from nicoffload.cli import app, busy, emit_json, handle_errors, ray_options
from nicoffload.errors import Mark, RunFailed, UserError
from nicoffload.graph import load_pipeline
from nicoffload.inputs import dir_items, sample_items
from nicoffload.outputs import OutputWriter
from nicoffload.runner import RunStats, prepare
from nicoffload.session import stream
from nicoffload.sizes import typical_of


def summary_table(stats: RunStats) -> Table:
    doc = stats.to_json()
    t = Table(title="nicoffload run", show_header=False, title_justify="left")
    t.add_row("items", f"{doc['items']}")
    errs = ", ".join(f"{k}: {v}" for k, v in doc["errors_by_reason"].items())
    t.add_row("errors", f"{doc['errors']}" + (f"  ({errs})" if errs else ""))
    for reason, example in doc.get("error_examples", {}).items():
        t.add_row(f"  first {reason}", example)
    pred = doc.get("predicted") or {}
    t.add_row(
        "throughput",
        f"{doc['throughput_per_s']:.1f} items/s"
        + _against(pred.get("throughput_per_s"), doc["throughput_per_s"], "{:.1f} items/s"),
    )
    t.add_row(
        "latency",
        f"p50 {doc['latency_ms']['p50']:.2f} ms   p99 {doc['latency_ms']['p99']:.2f} ms"
        + (
            f"   (predicted {pred['latency_ms']:.2f} ms for an item alone; "
            "the measured ones include queueing)"
            if pred.get("latency_ms") is not None
            else ""
        ),
    )
    t.add_row(
        "host CPU",
        f"{doc['host_cpu_ms_per_item']:.3f} ms/item"
        + _against(pred.get("host_cpu_ms_per_item"), doc["host_cpu_ms_per_item"], "{:.3f}"),
    )
    for name, st in doc["stages"].items():
        pred, err = st.get("predicted_ms_per_item"), st.get("error_pct")
        extra = (
            f"   (predicted {pred:.3f}" + (f", {err:+.0f}%)" if err is not None else ")")
            if pred is not None
            else ""
        )
        t.add_row(f"stage {name}", f"{st['ms_per_item']:.3f} ms/item on {st['device']}{extra}")
        for step, ms in st.get("steps", {}).items():
            t.add_row(f"  {step}", f"{ms:.3f} ms/item")
    for name, tr in doc["transfers"].items():
        flight = (
            f", {tr['ms_per_batch']:.2f} ms/batch" if tr.get("ms_per_batch") is not None else ""
        )
        t.add_row(
            f"transfer {name}",
            f"{tr['tensor']} over {tr['transport']}: {tr['bytes_per_item'] / 1e3:.0f} KB/item "
            f"(planned for {tr['predicted_bytes_per_item'] / 1e3:.0f}), {tr['batches']} batches"
            f"{flight}",
        )
        if land := tr.get("gpu_landing"):
            t.add_row(
                "  into the GPU",
                f"{land['destination']}: {land['batches']} batches ({land['reason']})",
            )
    if doc.get("failover"):
        t.add_row("failover", f"the DPU agent's items ran on the host: {doc['failover']}")
    if doc.get("assisted"):
        t.add_row(
            "host assist",
            f"{doc['assisted']} of {doc['items']} items ran the DPU stage on the host "
            "while the agent was busy (the plan's host assist)",
        )
    return t


def _against(predicted: float | None, measured: float, fmt: str) -> str:
    """`   (predicted X, +N%)`: the plan's figure beside a measured one (its error against
    the measurement), or "" when the plan has none."""
    if predicted is None:
        return ""
    err = f", {100 * (predicted - measured) / measured:+.0f}%" if measured else ""
    return f"   (predicted {fmt.format(predicted)}{err})"


def check_token_file(token_file: Path | None) -> None:
    """A --token-file that cannot be read is refused before anything is planned or started."""
    if token_file is None:
        return
    try:
        with open(token_file, "rb"):
            pass
    except OSError as exc:
        raise UserError(
            f"--token-file: cannot read the token file: {exc.strerror or exc}",
            Mark(str(token_file), 1, 1),
        ) from None


def failed_items(doc: dict[str, Any], strict: bool) -> str | None:
    """Why a finished run failed through its items, or None: every item failed, or (--strict)
    any did. The counts by reason, with each reason's first item."""
    errors, items = doc["errors"], doc["items"]
    if not errors or (errors < items and not strict):
        return None
    head = (
        f"every item failed ({errors} of {items})"
        if errors == items
        else f"{errors} of {items} items failed, and --strict makes any failure fatal"
    )
    examples = doc.get("error_examples", {})
    reasons = "; ".join(
        f"{reason}: {n}" + (f" (first: {examples[reason]})" if reason in examples else "")
        for reason, n in doc["errors_by_reason"].items()
    )
    return f"run: {head}: {reasons}"


def report(stats: RunStats, json_out: bool) -> None:
    if json_out:
        emit_json(stats.to_json())
    else:
        Console().print(summary_table(stats))


@app.command()
@handle_errors
def run(
    pipeline: Path = typer.Argument(..., help="the pipeline YAML file"),
    input_dir: Path | None = typer.Option(
        None, "--input", help="a folder of input files (one item per file; see README)"
    ),
    sample: int | None = typer.Option(
        None, "--sample", min=1, help="generate N realistic sample items instead"
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        help="write outputs as .npy files + items.json here; replaced as a whole on success only",
    ),
    plan: Path | None = typer.Option(None, "--plan", help="a plan from `nicoffload plan --output`"),
    topology: Path | None = typer.Option(
        None,
        "--topology",
        help="plan for this topology file (default: this machine: host CPU + a local DPU agent)",
    ),
    token_file: Path | None = typer.Option(
        None, "--token-file", help="the shared secret of the DPU agents the topology names"
    ),
    workers: int | None = typer.Option(
        None, "--workers", min=1, help="worker threads (default: the host's cores in the topology)"
    ),
    seed: int = typer.Option(0, "--seed", help="seed for --sample"),
    strict: bool = typer.Option(
        False, "--strict", help="any failed item fails the run (exit 1, --output not written)"
    ),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
    host_assist: bool = typer.Option(
        False,
        "--host-assist",
        help="plan with host assist weighed (as `plan --host-assist`): the host may run the "
        "DPU stage for a share of the items while the agent is busy; not with --plan (a plan "
        "file carries its own)",
    ),
    ray: str | None = typer.Option(None, "--ray", help=ray_options.RAY_HELP),
    ray_network: Path | None = typer.Option(None, "--ray-network", help=ray_options.NETWORK_HELP),
    ray_server: str | None = typer.Option(None, "--ray-server", help=ray_options.SERVER_HELP),
) -> None:
    """Run a pipeline over a folder of files or generated samples; print throughput, latency,
    per-stage time and host-CPU time. Corrupt items are counted by reason; a run fails (exit 1)
    only when every item failed, or with --strict when any did. A stage's ms/item is the CPU
    time its kernels took per item in the worker that ran them (core-ms, as the planner
    predicts it; queue waits excluded); --json adds the calls' wall time."""
    if (input_dir is None) == (sample is None):
        raise UserError("give exactly one of --input DIR or --sample N", Mark(str(pipeline), 1, 1))
    if host_assist and plan is not None:
        raise UserError(
            "--host-assist plans the run; a plan file carries its own host assist "
            "(`nicoffload plan --host-assist -o plan.json`)",
            Mark(str(plan), 1, 1),
        )
    check_token_file(token_file)
    ray_options.check(ray, {"--topology": topology, "--ray-network": ray_network,
                            "--ray-server": ray_server})  # fmt: skip
    found = None if ray is None else ray_options.discovered(ray, ray_network, ray_server)
    topology = found.topology if found else topology
    pl = load_pipeline(pipeline)
    err = Console(stderr=True)
    if sample is not None:
        with err.status(f"making {sample} sample items"):
            items: Any = sample_items(pl, sample, seed)
        count = len(items)
    else:
        count, items = dir_items(pl, input_dir)
    typical = None
    if plan is None:  # planned for the sizes of these items, read from their headers
        with busy("reading the inputs' sizes"):
            typical = typical_of(pl, items if sample is not None else dir_items(pl, input_dir)[1])
    with busy("planning" if plan is None else "loading the plan"):
        prep = prepare(pl, plan, topology, token_file, typical, host_assist=host_assist)
    stats = RunStats()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    writer = OutputWriter(output, pl, count) if output else None
    with (
        writer or contextlib.nullcontext(),
        progress,
        ray_options.agents_for(ray, found, prep, token_file) as prep,
    ):
        task = progress.add_task(pl.name, total=count)
        for batch in stream(prep, items, stats, workers=workers):
            if writer:
                writer.write(batch.numpy())  # CUDA outputs copied to the host here only
            progress.advance(task, len(batch))
        if why := failed_items(stats.to_json(), strict):
            report(stats, json_out)  # what failed, and how: on stdout as a success would be
            raise RunFailed(why)
        if writer:
            writer.commit(stats.to_json())
    report(stats, json_out)
    if output and not json_out:
        err.print(f"outputs written to {output}/ (one .npy per output, items.json, summary.json)")
