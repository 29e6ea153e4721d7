"""The (pipeline id, stage id) a plan's frames carry in their header, and the NIC steers on.

A pipeline's id is the CRC-32 of its name; its stages are numbered from 1 in plan order, and the
frames bound for the egress device (the model's GPU) carry EGRESS_STAGE_ID. 0/0, what senders
stamp when no plan told them otherwise, is never installed: such frames take the slow path.
"""

from __future__ import annotations

import zlib

from nicoffload.planner.plan import Plan

EGRESS_STAGE_ID = 0xFFFF


def pipeline_id(name: str) -> int:
    """A stable 32-bit id for a pipeline name (never 0, which means 'no pipeline')."""
    return zlib.crc32(name.encode()) or 1


def stage_ids(plan: Plan) -> dict[str, int]:
    """Stage name -> stage id (1, 2, ...); 'egress' -> EGRESS_STAGE_ID when the plan has one."""
    if len(plan.stages) >= EGRESS_STAGE_ID:
        raise ValueError(f"a plan of {len(plan.stages)} stages does not fit 16-bit stage ids")
    ids = {s.name: i for i, s in enumerate(plan.stages, start=1)}
    if plan.egress is not None:
        ids["egress"] = EGRESS_STAGE_ID
    return ids
