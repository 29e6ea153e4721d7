"""`nicoffload plan`: place a pipeline on a topology and explain the choice."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import typer

from nicoffload.cli import app, busy, emit_json, handle_errors, ray_options
from nicoffload.planner.plan import Plan


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _kb(n: float) -> str:
    return f"{n / 1e3:,.0f} KB"


def render(plan: Plan, width: int = 120, seconds: float | None = None) -> list[Any]:
    """The plan as rich renderables: placement, latency breakdown, loads, runner-up. The
    placement is a node x device table when that fits in `width` columns, else one row per
    node with its device and the cheapest other one. `seconds`: how long planning took."""
    from rich.table import Table
    from rich.text import Text

    ex, pred = plan.explain, plan.predicted
    out: list[Any] = []
    head = f"pipeline '{plan.pipeline}' on topology '{plan.topology}', objective {plan.objective}"
    limits = {k: v for k, v in ex.get("constraints", {}).items() if v is not None}
    if limits:
        head += " (" + ", ".join(f"{k}={v:g}" for k, v in limits.items()) + ")"
    out.append(Text(head, style="bold"))
    out.append(_placement(ex.get("nodes", {}), width))
    flow = Table(title="per item: stages and transfers (predicted ms)", title_justify="left")
    for col in ("step", "where", "transport", "bytes", "ms/item"):
        flow.add_column(col, justify="right" if col in ("bytes", "ms/item") else "left")
    io_in = [t for t in plan.io_transfers if t.src_stage == "ingress"]
    io_out = [t for t in plan.io_transfers if t.dst_stage == "egress"]
    for t in io_in:
        flow.add_row(
            f"in {t.tensor}",
            t.link or "",
            t.transport,
            _kb(t.bytes_per_item),
            _ms(t.predicted_ms_per_item),
        )
    for s in plan.stages:
        flow.add_row(
            f"{s.name} [{' '.join(s.nodes)}]", s.device, "", "", _ms(s.predicted_ms_per_item)
        )
        for t in plan.transfers:
            if t.src_stage == s.name:
                flow.add_row(
                    f"  {t.tensor} -> {t.dst_stage}",
                    t.link or "",
                    t.transport,
                    _kb(t.bytes_per_item),
                    _ms(t.predicted_ms_per_item),
                )
    for t in io_out:
        flow.add_row(
            f"out {t.tensor}",
            t.link or "",
            t.transport,
            _kb(t.bytes_per_item),
            _ms(t.predicted_ms_per_item),
        )
    out.append(flow)
    title = "load per item (the busiest resource bounds throughput)"
    if helped := ex.get("host_assist"):  # these loads are the agent's path alone
        title = (
            f"load per item of this placement without host assist (with it the host also runs "
            f"stage {helped['stage']} for about {helped['host_share']:.0%} of the items)"
        )
    loads = Table(title=title, title_justify="left")
    for col in ("resource", "work", "capacity", "ms/item", ""):
        loads.add_column(col, justify="left" if col == "resource" else "right")
    top = ex.get("bottleneck", {}).get("resource")
    for r in [*ex.get("devices", {}).values(), *ex.get("links", {}).values()]:
        if r["kind"] == "device":
            work, cap = f"{r['work_core_ms_per_item']:.4f} core-ms", f"{r['capacity']:g} workers"
        else:
            work, cap = _kb(r["bytes_per_item"]), f"{r['bandwidth_gbps']:g} Gb/s"
        loads.add_row(
            r["resource"],
            work,
            cap,
            _ms(r["load_ms_per_item"]),
            "bottleneck" if r["resource"] == top else "",
        )
    out.append(loads)
    if pred:
        out.append(
            Text(
                f"predicted: {pred.throughput_per_s:,.0f} items/s, latency {pred.latency_ms:.3f} ms, "
                f"host CPU {pred.host_cpu_ms_per_item:.4f} ms/item",
                style="bold",
            )
        )
    if plan.search:
        out.append(Text(search_line({**plan.search, "seconds": seconds})))
    ru = ex.get("runner_up")
    if ru:
        moved = ", ".join(f"{n} {a}->{b}" for n, (a, b) in ru["differs"].items())
        p = ru["predicted"]
        out.append(
            Text(
                f"runner-up ({moved}): {p['throughput_per_s']:,.0f} items/s, latency {p['latency_ms']:.3f} ms, "
                f"host CPU {p['host_cpu_ms_per_item']:.4f} ms/item\n  lost on {ru['lost_on']} ({ru['reason']}): {ru['why']}"
            )
        )
        turns = [s["text"] for s in ru.get("would_win_if", ()) if s["factor"] is not None]
        if turns:
            out.append(Text("  the runner-up would win with " + "; ".join(turns), style="dim"))
    elif ex:
        from nicoffload.planner.solve import INFEASIBLE

        why = ex.get("runner_up_missing") or INFEASIBLE
        out.append(Text(f"runner-up: none ({why})"))
    for note in plan.notes:
        out.append(Text(f"note: {note}", style="dim"))
    return out


def _placement(nodes: dict[str, Any], width: int) -> Any:
    from rich.table import Table

    devices = list(next(iter(nodes.values()))["core_ms_by_device"]) if nodes else []
    cell = 7  # "*0.1234"
    name = max((len(n) for n in nodes), default=4)
    wide = name + 4 + sum(max(len(d), cell) + 3 for d in devices)
    if wide <= width:
        table = Table(
            title="placement (core-ms per item on each device; * chosen)", title_justify="left"
        )
        table.add_column("node")
        for d in devices:
            table.add_column(d, justify="right")
        for n, info in nodes.items():
            cells = []
            for d in devices:
                v = info["core_ms_by_device"][d]
                c = "-" if isinstance(v, str) else f"{v:.4f}"
                cells.append(f"*{c}" if d == info["device"] else c)
            table.add_row(n, *cells)
        return table
    table = Table(
        title=f"placement (core-ms per item; the cheapest other of {len(devices)} devices beside it)",
        title_justify="left",
    )
    for col in ("node", "device", "core-ms", "cheapest other", "its core-ms", "can run on"):
        table.add_column(col, justify="right" if "core-ms" in col else "left")
    for n, info in nodes.items():
        here = info["device"]
        costs = {d: v for d, v in info["core_ms_by_device"].items() if not isinstance(v, str)}
        others = sorted((v, d) for d, v in costs.items() if d != here)
        other = others[0] if others else None
        table.add_row(
            n,
            here,
            _ms(costs.get(here)),
            other[1] if other else "-",
            _ms(other[0]) if other else "-",
            f"{len(costs)} of {len(devices)}",
        )
    return table


@app.command()
@handle_errors
def plan(
    pipeline: Path = typer.Argument(..., help="the pipeline YAML file"),
    topology: Path | None = typer.Option(
        None, "--topology", help="a topology YAML file (default: this machine)"
    ),
    profile: list[Path] | None = typer.Option(
        None, "--profile", help="a profile JSON for the devices of its kind (repeatable)"
    ),
    objective: str = typer.Option(
        "throughput", "--objective", help="throughput | latency | host-cpu"
    ),
    min_throughput: float | None = typer.Option(
        None, "--min-throughput", help="throughput floor, items/s"
    ),
    max_latency_ms: float | None = typer.Option(
        None, "--max-latency-ms", help="latency SLO per item, ms"
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="write the plan here (for `run --plan`)"
    ),
    json_out: bool = typer.Option(
        False, "--json", help="print the plan and its explanation as JSON"
    ),
    time_limit: float = typer.Option(
        20.0,
        "--time-limit",
        min=0.1,
        help="seconds for the whole search (plan, then runner-up). Chains are exact at once; a "
        "DAG's MILP that reaches the limit returns its best plan and a note with the proven gap",
    ),
    input_dir: Path | None = typer.Option(
        None,
        "--input",
        help="price items at the sizes of this folder's files (as `run --input` reads them; "
        "JPEG sizes from their headers) instead of the pipeline's `typical`",
    ),
    runnable: bool | None = typer.Option(
        None,
        "--runnable/--any-shape",
        help="accepted and ignored (deprecated, removed in the next release): the runtime runs "
        "every placement, so every plan is the best overall",
    ),
    host_assist: bool = typer.Option(
        False,
        "--host-assist",
        help="throughput objective: also weigh the plan with its leading nodes on a DPU and the "
        "host running them for a share of the items while the agent is busy (the DPU's cores "
        "added to the host's rather than replacing them); taken where predicted faster",
    ),
    ray: str | None = typer.Option(None, "--ray", help=ray_options.RAY_HELP),
    ray_network: Path | None = typer.Option(None, "--ray-network", help=ray_options.NETWORK_HELP),
    ray_server: str | None = typer.Option(None, "--ray-server", help=ray_options.SERVER_HELP),
) -> None:
    """Place every node on a device (exact: DP for chains, MILP for DAGs) and explain why."""
    from nicoffload.errors import PlanError
    from nicoffload.graph import load_pipeline
    from nicoffload.planner import OBJECTIVES, plan_for

    if objective not in OBJECTIVES:
        raise PlanError(f"--objective must be one of {', '.join(OBJECTIVES)}, got '{objective}'")
    for flag, value in (("--min-throughput", min_throughput), ("--max-latency-ms", max_latency_ms)):
        if value is not None and value <= 0:
            raise PlanError(f"{flag} must be a positive number, got {value:g}")
    if runnable is not None:
        typer.echo(
            "note: --runnable/--any-shape is a no-op (the runtime runs every placement); "
            "it goes in the next release",
            err=True,
        )
    ray_options.check(ray, {"--topology": topology, "--ray-network": ray_network,
                            "--ray-server": ray_server})  # fmt: skip
    if ray is not None:
        topology = ray_options.discovered(ray, ray_network, ray_server).topology
    pl = load_pipeline(pipeline)
    typical = None
    if input_dir is not None:
        from nicoffload.inputs import dir_items
        from nicoffload.runner import priced_at, typical_note
        from nicoffload.sizes import typical_of

        with busy("reading the inputs' sizes"):
            typical = typical_of(pl, dir_items(pl, input_dir)[1])
        pl = priced_at(pl, typical)
    import time

    started = time.perf_counter()
    with busy(f"planning {len(pl.nodes)} nodes for {objective}"):
        the_plan = plan_for(
            pl,
            topology,
            profile or None,
            objective,
            min_throughput_per_s=min_throughput,
            max_latency_ms=max_latency_ms,
            explain=True,
            time_limit_s=time_limit,
            host_assist=host_assist,
        )
    # this run's planning (reading the files and building the model included): not part of
    # the plan, which is the same on every run
    seconds = round(time.perf_counter() - started, 3)
    if typical:
        the_plan = dataclasses.replace(the_plan, notes=(*the_plan.notes, typical_note(typical)))
    if output is not None:
        the_plan.save(output)
    from nicoffload.transport import gpudirect

    landing = gpudirect.for_plan(the_plan)  # this machine's check, not part of the saved plan
    if json_out:
        doc = the_plan.to_json()
        doc["search"]["seconds"] = seconds  # the one figure of this run, not of the plan
        if landing:
            doc["gpu_destinations"] = landing
        emit_json(doc)
        return
    import sys

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 120)
    for part in render(the_plan, console.width, seconds):
        console.print(part)
    for line, warning in landing_lines(landing):
        console.print(line)
        if warning:
            console.print(f"warning: {warning}", style="yellow")
    if output is not None:
        typer.echo(f"plan written to {output}", err=True)


def landing_lines(landing: list[dict], shown: int = 3) -> list[tuple[str, str | None]]:
    """`gpudirect.for_plan`'s rows as lines, one per link, landing and reason (with its warning,
    once): a 200-node DAG has dozens of such transfers, all landing alike."""
    groups: dict[tuple, list[str]] = {}
    for d in landing:
        key = (d["link"], d["destination"], d["reason"], d.get("warning"))
        groups.setdefault(key, []).append(d["transfer"])
    out = []
    for (link, destination, reason, warning), transfers in groups.items():
        pairs = list(dict.fromkeys(transfers))  # a stage pair may carry several tensors
        which = ", ".join(pairs[:shown]) + (
            f" and {len(pairs) - shown} more" if len(pairs) > shown else ""
        )
        what = which if len(transfers) == 1 else f"{len(transfers)} transfers ({which})"
        out.append((f"into the GPU, {what} over {link}: {destination} ({reason})", warning))
    return out


def search_line(search: dict) -> str:
    """'search: MILP (...), 4.31 s: proven optimal' and the like, from Plan.search and the
    seconds it took (when given)."""
    gap, tie = search.get("gap"), search.get("tie_break_gap")
    if gap is None:
        what = "no bound proven (time limit)"
    elif gap > 1e-6:
        what = f"proven within {gap:.1%} of the optimum (time limit)"
    elif tie is None or tie > 1e-6:
        what = "objective proven optimal; its tie-break " + (
            "not proven (time limit)" if tie is None else f"within {tie:.1%} (time limit)"
        )
    else:
        what = "proven optimal"
    if search.get("stopped_at_time_limit") and (gap is not None and gap <= 1e-6):
        what += " (time limit reached: among ties, another run may choose another)"
    if weighed := search.get("host_assist_weighed"):
        what += (
            f" without host assist; with it, the best of {weighed} placements weighed (the "
            "plan's, its leading nodes on each DPU), not proven optimal"
        )
    took = f", {search['seconds']:.2f} s" if search.get("seconds") is not None else ""
    return f"search: {search['method']}{took}: {what}"
