"""Plans with a DPU stage, and the topology that names a test's agent process as a real DPU
(so a run connects, loads and streams exactly as it would against a BlueField's agent)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import Pipeline
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.topology import Device, Link, Topology

# ResNet-50's decode, resize and crop on the DPU, normalize on the host
SPLIT = {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"}


def plan_of(
    pipeline: Pipeline,
    placement: dict[str, str],
    topology: str = "test",
    transport: str | None = None,
) -> Plan:
    """The plan of a placement, its transfers over `transport` when given."""
    stages, transfers = stages_for(pipeline, placement)
    if transport is not None:
        transfers = tuple(dataclasses.replace(t, transport=transport) for t in transfers)
    return Plan(pipeline.name, dict(placement), stages, transfers, topology=topology)


def agent_topology(agent: Any) -> Topology:
    """The host CPU and `agent` (a LocalAgent) as dpu0, over tcp."""
    dpu = Device("dpu0", "dpu", 1, 1.0, address=agent.address)
    cpu = Device("cpu", "cpu", 1, 1.0)
    link = Link("dpu0", "cpu", "tcp", 1e9, 0.0, 0.0)
    return Topology("test", (cpu, dpu), (link,), ingress="dpu0", egress="cpu", source="test")


def run_on_agent(pipeline: Any, items: Any, plan: Plan, agent: Any) -> Any:
    """`nicoffload.run` of `plan` with `agent` (a LocalAgent with its `token_file`) as dpu0."""
    import nicoffload

    return nicoffload.run(
        pipeline,
        items,
        plan=plan,
        topology=agent_topology(agent),
        token_file=agent.token_file,
        workers=2,
    )


@contextlib.contextmanager
def token_agent(folder: Path) -> Iterator[LocalAgent]:
    """A LocalAgent on one core with a fresh token in `folder`, its `token_file` set (as
    `run_on_agent` reads it)."""
    token = folder / "agent.token"
    auth.write_token(token)
    with LocalAgent(token, cores=1) as a:
        a.token_file = token
        yield a
