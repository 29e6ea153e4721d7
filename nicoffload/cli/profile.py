"""`nicoffload profile`: measure what each kernel and link costs on this machine, for the planner."""

from __future__ import annotations

from pathlib import Path

import typer

from nicoffload.cli import app, emit_json, handle_errors


@app.command()
@handle_errors
def profile(
    device: str = typer.Option(
        "cpu", "--device", help="cpu | dpu (run on the DPU itself) | gpu | dpu@HOST:PORT"
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        help="where to write it (default: this machine's profile, which plan and run use)",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="fewer sizes and shorter timing (a rougher profile)"
    ),
    json_out: bool = typer.Option(False, "--json", help="print the profile as JSON"),
) -> None:
    """Run every registered kernel of a device over a range of input sizes, fit `a + b * work`,
    measure the local transports, and write the profile (machine, date and method included).
    Kernels are timed as a run executes them: one worker per core, all busy at once, each item
    in its own buffers; the fitted figure is each worker's CPU time per call. GPU profiles come
    from `bench/bench_gpu.py` (batched kernels); `--device gpu` says how."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nicoffload.errors import DeviceError, ProfileError
    from nicoffload.profiles import measured_path
    from nicoffload.profiling import measure

    kind, _, address = device.partition("@")
    if kind not in ("cpu", "dpu", "gpu"):
        raise ProfileError(f"--device must be cpu, dpu, gpu or dpu@HOST:PORT, got '{device}'")
    if address:
        raise DeviceError(
            f"profiling through the DPU agent at {address} is not available yet; run "
            "`nicoffload profile --device dpu` on the DPU itself and copy the file to this host "
            "(then pass it to `plan --profile`, or name it in the topology's `profile:`)"
        )
    if kind == "gpu":
        # GPU kernels run on whole batches (nvJPEG's batched decode, one resampler launch per
        # batch): the per-item sweep below does not price them. bench_gpu.py measures them
        # batched, as the runtime calls them, and writes the profile (the shipped h200.json).
        raise DeviceError(
            "GPU kernels are profiled batched, as the runtime calls them: run "
            "`python bench/bench_gpu.py --out DIR --sections kernels,profile` on the GPU machine "
            "and name DIR/<gpu>.json in the topology's `profile:` (or pass it to `plan --profile`)"
        )
    with Progress(
        TextColumn(f"profiling {kind} kernels"),
        BarColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=None,
    ) as bar:
        task = bar.add_task("kernels", total=None)

        def progress(total: int | None = None, advance: int = 0) -> None:
            if total is not None:
                bar.update(task, total=total)
            bar.advance(task, advance)

        result = measure(kind, quick=quick, progress=progress)
    path = output or measured_path(kind)
    result.save(path)
    if json_out:
        emit_json(result.to_json())
        return
    typer.echo(f"profile of {kind} ({result.machine.get('cpu', '?')}) written to {path}", err=True)
    for key, cost in sorted(result.kernels.items()):
        more = f" + {cost.c_ms:.3e} ms/encoded byte" if cost.c_ms else ""
        if cost.progressive_x is not None:
            more += f"; progressive JPEGs {cost.progressive_x:.2f}x"
        typer.echo(
            f"  {key:<30} {cost.a_ms:8.4f} ms + {cost.b_ms:.3e} ms/{cost.unit.rstrip('s')}{more}"
        )
    if result.runtime_us_per_item is not None:
        typer.echo(f"  host runtime                   {result.runtime_us_per_item:8.1f} us/item")
    if result.agent_us_per_item is not None:
        per_batch = result.agent_us_per_batch
        typer.echo(
            f"  agent runtime                  {result.agent_us_per_item:8.1f} us/item"
            + ("" if per_batch is None else f" + {per_batch:.1f} us/batch")
        )
    if result.serial_us_per_item is not None:
        typer.echo(
            f"  host process serial (GIL)      {result.serial_us_per_item:8.1f} us/item"
            f" + {result.serial_us_per_batch or 0.0:.1f} us/batch per stage"
        )
    for name, link in sorted(result.links.items()):
        typer.echo(
            f"  link {name:<25} {link.latency_ms * 1e3:6.1f} us, {link.bandwidth * 8 / 1e9:6.1f} Gb/s, "
            f"CPU per end {link.cpu_us_per_batch:.1f} us/batch + {link.cpu_ns_per_byte:.3f} ns/byte"
        )
