"""Placement: which device runs each node, from the topology and measured profiles.

`plan_for(pipeline, topology=None, profile=None, objective="throughput")` is the entry point;
it is loaded on first use so that importing `nicoffload.planner.plan` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OBJECTIVES", "plan_for", "plan_placement"]


def __getattr__(name: str) -> Any:
    if name == "plan_for":
        from nicoffload.planner.solve import plan_for

        return plan_for
    if name == "plan_placement":
        from nicoffload.planner.solve import plan_placement

        return plan_placement
    if name == "OBJECTIVES":
        from nicoffload.planner.evaluate import OBJECTIVES

        return OBJECTIVES
    raise AttributeError(f"module 'nicoffload.planner' has no attribute '{name}'")
