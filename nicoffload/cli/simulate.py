"""`nicoffload simulate`: what a fleet would do under each placement policy (`nicoffload.fleet`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from nicoffload.cli import app, busy, emit_json, handle_errors
from nicoffload.errors import UserError


def parse_policies(text: str) -> tuple[str, ...]:
    from nicoffload.fleet import POLICIES
    from nicoffload.yamlmarks import did_you_mean

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    for name in names:
        if name not in POLICIES:
            raise UserError(f"--policy: unknown policy '{name}'{did_you_mean(name, POLICIES)}")
    if not names:
        raise UserError(f"--policy: name one or more of {', '.join(POLICIES)}")
    return names


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(doc: dict) -> Table:
    t = Table(
        title=f"fleet '{doc['fleet']}': {doc['servers']} servers, {doc['duration_s']:g} s simulated",
        title_justify="left",
    )
    for col in ("policy", "offered/s", "goodput/s", "host cores", "saved", "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for p in doc["policies"]:
        t.add_row(
            p["policy"] + (" (saturated)" if p["saturated"] else ""),
            f"{p['offered_per_s']:,.0f}",
            f"{p['goodput_per_s']:,.0f}",
            f"{p['host_cpu_cores']:,.1f}",
            f"{p['host_cpu_saved_cores']:,.1f} ({p['host_cpu_saved_share']:.0%})",
            _ms(p["p50_ms"]),
            _ms(p["p99_ms"]),
        )
    return t


@app.command()
@handle_errors
def simulate(
    fleet: Path = typer.Argument(..., help="the fleet YAML file (server kinds, counts, mix)"),
    policy: str = typer.Option(
        "all-host,planner,planner+assist,min-host-cpu",
        "--policy",
        help="placement policies to compare, comma-separated",
    ),
    duration: float | None = typer.Option(
        None, "--duration", help="simulated seconds (default: the fleet file's, else 10)"
    ),
    seed: int | None = typer.Option(
        None, "--seed", help="the arrivals' seed (default: the file's)"
    ),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document on stdout"),
    plot_file: Path | None = typer.Option(
        None,
        "--plot",
        help="draw goodput, host CPU saved and latency per policy (PNG; extra 'plot')",
    ),
) -> None:
    """Predict each placement policy's goodput, host CPU saved against all-host, and p50/p99 latency for a fleet, by a discrete-event simulation of the planner's cost model (one representative server per kind, scaled by its count). Needs the extra 'fleet' (simpy).

    Policies: all-host (every node on the host CPU), planner (the planner's throughput plan), planner+assist (with host assist weighed), min-host-cpu (the planner's least-host-CPU plan).
    """
    from nicoffload.fleet import load_fleet
    from nicoffload.fleet import simulate as run

    if duration is not None and duration <= 0:
        raise UserError("--duration: give simulated seconds > 0")
    policies = parse_policies(policy)
    spec = load_fleet(fleet)
    with busy(f"simulating {spec.count} servers under {len(policies)} policies"):
        result = run(spec, policies, duration, seed)
    doc = result.to_json()
    if plot_file is not None:
        from nicoffload.fleet.plot import plot

        plot(result, str(plot_file))
    if json_out:
        emit_json(doc)
    else:
        console = Console()
        Console(width=max(console.width, 100)).print(table(doc))  # one line per policy
