"""What-if simulation of a fleet: from a fleet file (server kinds and counts, a request mix,
link speeds) and the planner's cost model, each placement policy's goodput, host CPU saved
against all-host, and p50/p99 latency, by a discrete-event simulation (simpy: `[fleet]` extra).

    from nicoffload.fleet import load_fleet, simulate
    result = simulate(load_fleet("fleet.yaml"), policies=("all-host", "planner"))

`spec` reads the file, `servers` a kind's topology, `model` a server's stations under a
policy, `sim` one server's events, `run` the fleet's figures, `plot` the `--plot` figure.
"""

from __future__ import annotations

from nicoffload.fleet.model import POLICIES
from nicoffload.fleet.run import FleetResult, PolicyResult, StreamResult, simulate
from nicoffload.fleet.spec import Fleet, FleetError, load_fleet

__all__ = [
    "POLICIES",
    "Fleet",
    "FleetError",
    "FleetResult",
    "PolicyResult",
    "StreamResult",
    "load_fleet",
    "simulate",
]
