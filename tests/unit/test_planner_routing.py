"""Counts routed without HiGHS (routing.py): counts that name one device per position give the
packing HiGHS's routing of them gives; counts that leave a choice, or name a path over the
problem's latency bound, are left to HiGHS."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from test_planner_properties import SEEDS, _random_paths, random_branches

from nicoffload.planner.branches import chain_classes, suffixes
from nicoffload.planner.flow import FlowProblem, placement
from nicoffload.planner.routing import route


def _counts(problem: FlowProblem, paths: list[np.ndarray]) -> np.ndarray:
    """The count columns' values of the copies on `paths` (per class, chain arcs)."""
    D = len(problem.model.devices)
    out = []
    for c, (ch, rows) in enumerate(zip(problem.classes, paths, strict=True)):
        arcs = rows[:, :-1]
        keys = ch.pos[arcs] * D + ch.dev[arcs]
        out.append(np.array([(keys == k).sum() for k in problem.keys[c]], float))
    return np.concatenate(out)


def _one_path_each(seed: int) -> tuple:
    """A random instance whose copies of each class all take one random path."""
    model = random_branches(seed)
    classes = chain_classes(model)
    paths = [
        np.repeat(p[:1], ch.copies, axis=0)
        for ch, p in zip(classes, _random_paths(model, np.random.default_rng(seed)), strict=True)
    ]
    return model, classes, paths


@settings(max_examples=50, deadline=None, derandomize=True)
@given(SEEDS)
def test_counts_naming_one_device_per_position_are_routed_as_highs_routes_them(seed: int) -> None:
    model, classes, paths = _one_path_each(seed)
    problem = FlowProblem(model, classes, [None] * len(classes), np.inf)
    counts = _counts(problem, paths)
    got = route(problem, counts, np.inf, np.inf)
    fix = (np.concatenate(problem.counts), counts)
    want = problem._solve(None, np.inf, np.inf, 10.0, problem.integer, fix=fix)
    if want.paths is None:  # memory: HiGHS finds no routing, and neither may the walk
        assert got is None
        return
    assert got is not None
    assert np.array_equal(placement(model, classes, got.paths), placement(model, classes, paths))
    assert np.array_equal(
        placement(model, classes, got.paths), placement(model, classes, want.paths)
    )
    assert got.t == pytest.approx(want.t, rel=1e-9) and got.h == pytest.approx(want.h, rel=1e-9)


def test_counts_that_split_a_position_between_devices_are_left_to_highs() -> None:
    for seed in range(200):
        model = random_branches(seed)
        classes = chain_classes(model)
        paths = _random_paths(model, np.random.default_rng(seed))
        if any(
            (ch.dev[p[:, :-1]] != ch.dev[p[:1, :-1]]).any()
            for ch, p in zip(classes, paths, strict=True)
        ):
            break
    problem = FlowProblem(model, classes, [None] * len(classes), np.inf)
    assert route(problem, _counts(problem, paths), np.inf, np.inf) is None


def test_a_path_over_the_latency_bound_is_left_to_highs() -> None:
    model, classes, paths = _one_path_each(1)
    suff = [suffixes(ch) for ch in classes]
    latency = max(float(ch.latency(p).max()) for ch, p in zip(classes, paths, strict=True))
    under = FlowProblem(model, classes, suff, latency * 0.999)
    at = FlowProblem(model, classes, suff, latency)
    assert route(under, _counts(under, paths), np.inf, np.inf) is None
    assert route(at, _counts(at, paths), np.inf, np.inf) is not None


def test_a_packing_over_the_load_cap_is_left_to_highs() -> None:
    model, classes, paths = _one_path_each(1)
    problem = FlowProblem(model, classes, [None] * len(classes), np.inf)
    counts = _counts(problem, paths)
    o = route(problem, counts, np.inf, np.inf)
    assert o is not None
    assert route(problem, counts, o.t * 0.999, np.inf) is None
    assert route(problem, counts, o.t, np.inf) is not None
