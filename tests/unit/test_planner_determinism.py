"""The planner is deterministic: the same inputs give the same plan, byte for byte, on an idle
machine and on one whose cores are taken by busy processes. Only the time limit may cut a
search (then the plan says so); every other limit of the search is a count of work."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_planner_properties import KERNELS, ROOT, TOPOLOGIES, random_branches, random_goal
from test_planner_properties import random_model as random_dag
from test_planner_time_limit import CATALOG, _write

from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for
from nicoffload.planner.evaluate import OBJECTIVES
from nicoffload.planner.milp import solve_milp

LIMIT_S = 600.0  # far beyond what any case here takes, loaded: no search is cut


@contextlib.contextmanager
def _burning(n: int = 2) -> Iterator[None]:
    """`n` busy-loop processes for the block: the planner then gets a fraction of a core."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _idle_and_loaded(plans: Callable[[], dict[str, str]]) -> None:
    idle = plans()
    with _burning():
        loaded = plans()
    differ = [k for k in idle if idle[k] != loaded[k]]
    assert not differ, f"another plan under load: {differ}"


def _doc(plan) -> str:
    doc = plan.to_json()
    assert doc["search"].get("stopped_at_time_limit") in (None, False), "a search was cut"
    return json.dumps(doc, indent=2)


def test_the_shipped_pipelines_plan_the_same_under_load() -> None:
    def plans() -> dict[str, str]:
        out = {}
        for name in ("resnet50", "bert", "clip"):
            pipeline = load_pipeline(ROOT / "pipelines" / f"{name}.yaml")
            for where in sorted(TOPOLOGIES):
                for objective in OBJECTIVES:
                    plan = plan_for(
                        pipeline,
                        TOPOLOGIES[where](),
                        objective=objective,
                        catalog=KERNELS,
                        explain=True,
                        time_limit_s=LIMIT_S,
                    )
                    out[f"{name} {where} {objective}"] = _doc(plan)
        return out

    _idle_and_loaded(plans)


@pytest.mark.parametrize("make", [random_dag, random_branches], ids=["any-dag", "branches"])
def test_random_dags_plan_the_same_under_load(make) -> None:
    seeds = range(12)

    def plans() -> dict[str, str]:
        out = {}
        for seed in seeds:
            model = make(seed)
            r = solve_milp(model, random_goal(model, seed), time_limit=LIMIT_S)
            assert not r.cut, seed
            placed = None if r.placement is None else r.placement.tolist()
            out[str(seed)] = json.dumps([placed, r.status, r.gap, r.tie_gap, r.solves])
        return out

    _idle_and_loaded(plans)


@pytest.fixture(scope="module")
def cameras(tmp_path_factory) -> tuple[Path, Path]:
    """12 camera and 12 caption branches over 2 sockets, 4 DPUs and 8 GPUs: the staged
    search's refutations, local search and re-checks all run on it."""
    return _write(tmp_path_factory.mktemp("cams"), 12)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_a_dag_of_twelve_camera_branches_plans_the_same_under_load(cameras, objective) -> None:
    pipeline = load_pipeline(cameras[0])

    def plans() -> dict[str, str]:
        plan = plan_for(
            pipeline,
            cameras[1],
            objective=objective,
            catalog=CATALOG,
            explain=True,
            time_limit_s=LIMIT_S,
        )
        return {objective: _doc(plan)}

    _idle_and_loaded(plans)


def test_a_plan_cut_by_its_time_limit_says_so(cameras) -> None:
    from nicoffload.errors import PlanError

    try:
        plan = plan_for(load_pipeline(cameras[0]), cameras[1], catalog=CATALOG, time_limit_s=0.1)
    except PlanError as exc:  # nothing found in time: and it says only that
        assert "found no placement in its 0.1 s time limit" in str(exc)
        return
    assert plan.search["stopped_at_time_limit"] is True
    assert any("time limit" in note for note in plan.notes)
