"""The search's shortcuts keep its answers exact, on small random instances of parallel chains
of mixed sizes (one class per chain, as cameras of different resolutions), against brute force:
the bucketed graphs kept by their key, the host-CPU stage that stops at the LP's bound, the
latency search, and a runner-up taken from the plan's tied neighbours."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import assume, given
from test_planner_properties import (
    SEEDS,
    SETTINGS,
    _agrees_with_brute_force,
    _model,
    random_goal,
    random_topology,
)

from nicoffload.planner.branches import bucket_key, bucketed, chain_classes, suffixes
from nicoffload.planner.cost import CostModel, TensorRef, routes
from nicoffload.planner.evaluate import REL_TOL, Goal, evaluate
from nicoffload.planner.flow import placement
from nicoffload.planner.milp import solve_milp
from nicoffload.planner.runner_up import search_runner_up
from nicoffload.planner.ties import neighbours, tied_neighbour


def mixed_chains(seed: int) -> CostModel:
    """2-4 chains of one kind (1-3 nodes), each scaled by its own size (0.5-2x the work and the
    bytes), so that no two are identical: a class each, up to 8 nodes."""
    rng = np.random.default_rng(seed)
    topo = random_topology(rng)
    rt = routes(topo, int(rng.choice([1, 8, 64])))
    D = len(topo.devices)
    length = int(rng.integers(1, 4))
    chains = int(rng.integers(2, 8 // length + 1))
    base = rng.uniform(0.01, 5.0, (length, D)) * rng.uniform(0.2, 5.0, D)
    allowed = rng.random((length, D)) < 0.8
    allowed[np.arange(length), rng.integers(0, D, length)] = True
    base = np.where(allowed, base, np.inf)
    nbytes = 10 ** rng.uniform(3, 6, length + 1)
    n = chains * length
    cost, mem, refs = np.empty((n, D)), np.empty(n), []
    for c in range(chains):
        size = rng.uniform(0.5, 2.0)
        nodes = list(range(c * length, (c + 1) * length))
        cost[nodes] = base * size
        mem[nodes] = rng.uniform(1.0, 10.0, length) * size
        refs.append(TensorRef(f"in{c}", -1, (nodes[0],), False, float(nbytes[0] * size)))
        for i, v in enumerate(nodes):
            last = i == length - 1
            consumers = () if last else (nodes[i + 1],)
            refs.append(TensorRef(f"n{v}", v, consumers, last, float(nbytes[i + 1] * size)))
    mem_cap = rng.choice([np.inf, np.inf, 0.5, 0.8], D) * mem.sum()
    return _model(topo, rt, cost, [], sorted(refs, key=lambda r: r.src), mem, mem_cap)


def test_mixed_chains_are_one_class_each() -> None:
    model = mixed_chains(3)
    classes = chain_classes(model)
    assert classes is not None and all(ch.copies == 1 for ch in classes) and len(classes) > 1


@SETTINGS
@given(SEEDS)
def test_mixed_chains_are_planned_exactly(seed: int) -> None:
    model = mixed_chains(seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)


@SETTINGS
@given(SEEDS)
def test_the_tie_break_of_mixed_chains_is_exact(seed: int) -> None:
    """The secondary objective too, not only the primary: what the latency search and the
    host-CPU stage's shortcut decide."""
    from nicoffload.planner.evaluate import brute_force

    model = mixed_chains(seed)
    goal = random_goal(model, seed)
    truth = brute_force(model, goal)
    result = solve_milp(model, goal)
    if truth is None:
        assert result.placement is None
        return
    assume(result.gap == 0 and result.tie_gap == 0)
    got = evaluate(model, result.placement[None, :]).keys(goal.objective)
    want = truth[1].keys(goal.objective)
    assert got[0][0] == pytest.approx(want[0][0], rel=1e-6, abs=1e-9)
    # ties within REL_TOL on the primary may order the secondary either way
    assume(abs(got[0][0] - want[0][0]) <= 1e-9 * max(1.0, abs(want[0][0])))
    assert got[1][0] == pytest.approx(want[1][0], rel=1e-6, abs=1e-9)


@SETTINGS
@given(SEEDS)
def test_bounds_with_one_key_give_one_bucketed_graph(seed: int) -> None:
    """The graphs a search keeps by bucket_key are the graphs bucketed() builds for each bound."""
    rng = np.random.default_rng(seed)
    model = mixed_chains(seed)
    for ch in chain_classes(model):
        suff = suffixes(ch)
        lats = np.unique(np.maximum(0.0, suff[0]))
        bounds = np.r_[lats, lats * (1 + 3 * REL_TOL), lats * (1 - 3 * REL_TOL)]
        bounds = np.r_[bounds, rng.uniform(0, 1.5 * lats.max(), 8)]
        seen: dict[bytes, object] = {}
        for b in bounds:
            g = bucketed(ch, suff, float(b))
            key = bucket_key(ch, suff, float(b))
            if key in seen:
                h = seen[key]
                assert g.n_states == h.n_states and g.sink == h.sink
                for a, z in zip((g.arc, g.tail, g.head), (h.arc, h.tail, h.head), strict=True):
                    assert np.array_equal(a, z)
            seen[key] = g


def _second_best(model: CostModel, goal: Goal, best: np.ndarray) -> tuple[float, float] | None:
    """(primary, secondary) of the best placement other than `best`, by brute force."""
    allowed = [np.flatnonzero(model.allowed[v]) for v in range(model.n)]
    others = np.array(list(itertools.product(*allowed)))
    others = others[~np.all(others == best, axis=1)]
    if not len(others):
        return None
    m = evaluate(model, others)
    ok = np.flatnonzero(m.feasible(goal))
    if not len(ok):
        return None
    p, s = (k[ok] for k in m.keys(goal.objective))
    low = p.min()
    tied = p <= low + abs(low) * REL_TOL + 1e-12
    return float(low), float(s[tied].min())


@SETTINGS
@given(SEEDS)
def test_a_tied_neighbour_is_the_second_best_placement(seed: int) -> None:
    """A runner-up taken from the plan's neighbours (proven plans only) is as good as the
    best other placement there is, on the objective and its tie-break."""
    model = mixed_chains(seed)
    goal = random_goal(model, seed)
    result = solve_milp(model, goal)
    assume(result.placement is not None and result.gap == 0 and result.tie_gap == 0)
    best = result.placement
    tie = tied_neighbour(model, goal, best, model.allowed)
    second, missing, _ = search_runner_up(model, goal, best, model.allowed, 60.0, proven=True)
    truth = _second_best(model, goal, best)
    if truth is None:
        assert second is None and missing
        return
    assert second is not None and not np.array_equal(second, best)
    assert model.allowed[np.arange(model.n), second].all()
    p, s = (float(k[0]) for k in evaluate(model, second[None, :]).keys(goal.objective))
    assert p == pytest.approx(truth[0], rel=1e-6, abs=1e-9)
    if tie is not None:  # a tie is the second best on the tie-break too
        assert np.array_equal(second, tie)
        assert s == pytest.approx(truth[1], rel=1e-6, abs=1e-9)


def test_neighbours_are_one_move_away_and_allowed() -> None:
    model, best = next(
        (m, p)
        for m in map(mixed_chains, range(20, 60))
        if (p := solve_milp(m, Goal("throughput")).placement) is not None
    )
    P = neighbours(best, model.allowed)
    moved = (best != P).sum(axis=1)
    assert len(P) and (moved >= 1).all()
    assert model.allowed[np.arange(model.n), P].all()
    single = moved == 1
    assert single.sum() == (model.allowed.sum() - model.n)  # every other allowed device


def _least_host(model: CostModel) -> float:
    allowed = [np.flatnonzero(model.allowed[v]) for v in range(model.n)]
    m = evaluate(model, np.array(list(itertools.product(*allowed))))
    return float(m.host[m.feasible(Goal("host-cpu"))].min())


def _host_stage(model: CostModel):
    from nicoffload.planner.parallel import _min_h, _Search

    s = _Search(model, chain_classes(model), time.perf_counter() + 60.0)
    return _min_h(s, np.inf, np.inf), s


def test_a_packing_without_host_cpu_is_the_least_without_highs() -> None:
    """Where no device's memory is capped (a capped one may leave HiGHS to decide)."""
    model = next(
        m
        for m in map(mixed_chains, range(200))
        if not np.isfinite(m.mem_cap).any() and _least_host(m) == 0
    )
    stage, s = _host_stage(model)
    assert stage.value <= 1e-12 and stage.gap == 0 and s.solves == 0
    placed = placement(model, s.classes, stage.best.paths)
    m = evaluate(model, placed[None, :])
    assert m.feasible(Goal("host-cpu"))[0] and m.host[0] <= 1e-12


def test_the_host_stage_asks_highs_when_every_packing_uses_the_host() -> None:
    model = next(m for m in map(mixed_chains, range(200)) if _least_host(m) > 1e-9)
    stage, s = _host_stage(model)
    assert s.solves > 0
    assert stage.value == pytest.approx(_least_host(model), rel=1e-6, abs=1e-9)
