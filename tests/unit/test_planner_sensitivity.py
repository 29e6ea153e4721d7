"""`plan --explain`'s sensitivity: the factor of a device kind's speed or the links' bandwidth
at which the runner-up would beat the plan. Checked on random models against the cost model
itself: just short of the factor the plan still wins, just past it the runner-up does, and the
planner, re-run on the machine so changed, no longer returns the plan."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_planner_properties import random_goal, random_model

from nicoffload.planner.evaluate import evaluate
from nicoffload.planner.runner_up import search_runner_up
from nicoffload.planner.sensitivity import _wins, crossing, scaled, sensitivity
from nicoffload.planner.solve import solve


def with_kinds(model):
    return dataclasses.replace(model, kinds=tuple(d.rstrip("0123456789") for d in model.devices))


def test_the_factor_is_where_the_runner_up_overtakes() -> None:
    checked = 0
    for seed in range(24):
        checked += _check(seed)
    assert checked >= 5  # crossings really checked (6 of these seeds have one), not skipped


def _check(seed: int) -> int:
    model = with_kinds(random_model(seed))
    goal = random_goal(model, seed)
    best = solve(model, goal)
    if best is None:
        return 0
    second, _, _ = search_runner_up(model, goal, best, model.allowed, 10.0)
    if second is None:
        return 0
    checked = 0
    for what in ("link", *sorted(set(model.kinds))):
        f = crossing(model, goal, best, second, what)
        if f is None or abs(math.log(f)) < 1e-3:
            continue  # none, or a tie at the machine as it is: no room either side
        before, after = math.exp(math.log(f) * 0.98), math.exp(math.log(f) * 1.02)
        assert not _wins(scaled(model, what, before), goal, best, second), (seed, what, f)
        assert _wins(scaled(model, what, after), goal, best, second), (seed, what, f)
        moved = scaled(model, what, after)
        again = solve(moved, goal)
        assert again is not None
        m = evaluate(moved, np.stack([again, second])).keys(goal.objective)[0]
        assert m[0] <= m[1] * (1 + 1e-6) + 1e-9  # at least as good as the runner-up
        assert not np.array_equal(again, best)  # the plan changed
        checked += 1
    return checked


def test_a_faster_device_kind_costs_less_on_it_alone() -> None:
    model = with_kinds(random_model(3))
    fast = scaled(model, model.kinds[0], 2.0)
    on = np.array([k == model.kinds[0] for k in model.kinds])
    np.testing.assert_allclose(fast.cost[:, on], model.cost[:, on] / 2)
    np.testing.assert_array_equal(fast.cost[:, ~on], model.cost[:, ~on])


def test_no_runner_up_no_sensitivity() -> None:
    model = with_kinds(random_model(3))
    goal = random_goal(model, 3)
    assert sensitivity(model, goal, np.zeros(model.n, np.intp), None) == []


def test_a_runner_up_that_wins_only_inside_the_range_is_found() -> None:
    """Seed 68's runner-up wins with the links at 0.3-0.65x their bandwidth, not at 1/16:
    its advantage does not grow one way (the review's case)."""
    from test_planner_properties import random_branches

    from nicoffload.planner.milp import solve_milp

    model = random_branches(68)
    goal = random_goal(model, 68)
    best = solve_milp(model, goal).placement
    second = solve_milp(model, goal, exclude=best).placement
    assert not _wins(scaled(model, "link", 1 / 16), goal, best, second)
    f = crossing(model, goal, best, second, "link")
    assert f is not None and 0.65 < f < 0.8
    assert _wins(scaled(model, "link", f * 0.99), goal, best, second)


def test_the_host_process_is_the_host_cpus_alone() -> None:
    """A faster GPU does not shorten the Python that feeds it; a faster host CPU shortens
    every stage's serial time, and what other nodes load it with."""
    model = with_kinds(random_model(4))  # cpu0, gpu1, gpu2, dpu3
    D = len(model.devices)
    model = dataclasses.replace(model, serial=np.ones((2, D)), side=((0, 1, 0, 1.0),))
    assert set(model.kinds) == {"cpu", "gpu", "dpu"}
    for what in ("gpu", "dpu"):
        np.testing.assert_array_equal(scaled(model, what, 4.0).serial, model.serial)
    fast = scaled(model, "cpu", 2.0)
    np.testing.assert_array_equal(fast.serial, model.serial / 2)
    assert fast.side == ((0, 1, 0, 0.5),)  # node 0 on gpu1 loads cpu0: faster with it


def _on_the_cost_model(model, goal, best, second, what):
    return lambda g: _wins(scaled(model, what, math.exp(g)), goal, best, second)


def test_the_lines_scan_finds_the_factors_the_cost_model_does() -> None:
    """Throughput and host CPU without SLOs: the scan by lines (two evaluations) finds what
    the scan of the cost model at each factor finds."""
    from nicoffload.planner.evaluate import Goal
    from nicoffload.planner.sensitivity import _lines, scan

    compared = found = 0
    for seed in range(10):
        model = with_kinds(random_model(seed))
        for objective in ("throughput", "host-cpu"):
            goal = Goal(objective)
            best = solve(model, goal)
            if best is None:
                continue
            second, _, _ = search_runner_up(model, goal, best, model.allowed, 10.0)
            if second is None:
                continue
            for what in ("link", *sorted(set(model.kinds))):
                lines = _lines(model, goal, best, second, what)
                assert lines is not None
                want = scan(_on_the_cost_model(model, goal, best, second, what))
                got = scan(lines)
                assert (got is None) == (want is None), (seed, objective, what)
                if got is not None:
                    assert math.log(got) == pytest.approx(math.log(want), abs=1e-5)
                    found += 1
                compared += 1
    assert compared >= 40 and found >= 5  # factors really compared, not skipped


def test_a_latency_goal_is_scanned_on_the_cost_model() -> None:
    from nicoffload.planner.evaluate import Goal
    from nicoffload.planner.sensitivity import _lines

    model = with_kinds(random_model(3))
    best = np.zeros(model.n, np.intp)
    assert _lines(model, Goal("latency"), best, best, "link") is None
    assert _lines(model, Goal("throughput", max_latency_ms=1.0), best, best, "link") is None
