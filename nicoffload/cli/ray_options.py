"""`plan|run|serve --ray ADDRESS`: plan for a server of a Ray cluster (its topology from the nodes'
labels, see nicoffload.ray.topology) and run with its DPU agents started as Ray actors on their
nodes; the items and tensors go over our own transports. Needs the `ray` extra."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from nicoffload.errors import UserError

RAY_HELP = (
    "plan for a server of this Ray cluster (auto, HOST:PORT or ray://HOST:PORT): its devices "
    "from the nodes' labels nicoffload.io/role (host, dpu, gpu, cpu-pool), nicoffload.io/server "
    "and nicoffload.io/dpu-gen; `run` and `serve` start the plan's agents there as Ray actors"
)
NETWORK_HELP = (
    "with --ray: a network file (links by role: `between: [dpu, host]`, transport, bandwidth, "
    "latency; `profiles: {ROLE: profile}`); default: 200 Gb/s to a DPU, 25 Gb/s to a pool node"
)
SERVER_HELP = "with --ray: the server (nicoffload.io/server) to plan for; default: the only one"


def check(ray: str | None, flags: dict[str, Any]) -> None:
    """--ray with --topology is the user's mistake (the cluster gives it), and so is
    --ray-network or --ray-server without --ray."""
    for flag, value in flags.items():
        if value is None:
            continue
        if ray is None and flag.startswith("--ray-"):
            raise UserError(f"{flag} needs --ray ADDRESS")
        if ray is not None and not flag.startswith("--ray-"):
            raise UserError(
                f"{flag} and --ray exclude each other: the cluster gives the {flag[2:]}"
            )


def discovered(ray: str, network: Path | None, server: str | None) -> Any:
    """The server's ClusterTopology, read from the cluster at `ray` (what was left out of it is
    said on stderr)."""
    from nicoffload.ray.cluster import connected, discover

    with connected(ray):
        found = discover(network, server)
    for note in found.notes:
        typer.echo(f"note: {note}", err=True)
    return found


@contextlib.contextmanager
def agents_for(
    ray: str | None, found: Any, prep: Any, token_file: Path | None = None
) -> Iterator[Any]:
    """`prep` as it is without --ray; with it, `prep` attached to the agents of its DPU stages:
    those already running (nicoffload.io/agent-port, reached with `token_file`) and the others
    started as Ray actors on their nodes for the block and stopped after it."""
    if ray is None:
        yield prep
        return
    from nicoffload.ray.agents import AgentFleet
    from nicoffload.ray.cluster import connected

    devices = [s.device for s in prep.plan.stages if s.kind == "dpu"]
    with connected(ray), AgentFleet(found, devices, token_file) as fleet:
        for dev, d in fleet.descriptors.items():
            how = "attached" if d.get("attached") else f"started on Ray node {d['node_id'][:8]}"
            typer.echo(f"{dev}: agent at {d['address']} ({how})", err=True)
        yield fleet.attach(prep)
