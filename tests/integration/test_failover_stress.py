"""Failover at any moment: the emulated DPU's agent is killed (SIGKILL) or stopped (SIGTERM,
as `systemctl stop` does) at random moments of a split run, from before it listens, through
loading its stage, to the middle of the stream. Every run must finish every item exactly once,
bit for bit equal to the all-host run, and say why it failed over whenever it did."""

from __future__ import annotations

import random
import signal
import time

import numpy as np
import pytest
from agent_kill import signal_local_agents_after
from split_plans import SPLIT, plan_of

import nicoffload
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import Plan, single_device_plan
from nicoffload.samples import sample_images
from nicoffload.topology import local_topology

PIPELINE = load_pipeline("pipelines/resnet50.yaml")
TRIALS = 10


def split_plan(transport: str) -> Plan:
    return plan_of(PIPELINE, SPLIT, "local", transport)


DISTINCT = 60


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [b for _, b in sample_images(DISTINCT, seed=11)] * 3


@pytest.fixture(scope="module")
def host_outputs(images):
    """The all-host outputs of `images`: those of its DISTINCT images, repeated as they are
    (an item's outputs are its own, whatever else its batch holds)."""
    distinct = images[:DISTINCT]
    result = nicoffload.run(PIPELINE, distinct, plan=single_device_plan(PIPELINE, "cpu"))
    assert result.ok.all() and images == distinct * (len(images) // DISTINCT)
    return np.concatenate([result.outputs["pixels"]] * (len(images) // DISTINCT))


def run_hit_at(delay_s: float, sig: int, images, transport: str = "tcp"):
    with signal_local_agents_after(delay_s, sig) as pids:
        result = nicoffload.run(
            PIPELINE, images, plan=split_plan(transport), topology=local_topology(), workers=1
        )
    assert len(pids) == 1  # one agent per run: the session's
    return result


def check(result, host_outputs, what: str) -> None:
    assert result.names == [str(i) for i in range(len(host_outputs))], what  # once, in order
    assert result.ok.all(), f"{what}: {result.stats.errors_by_reason}"
    bad = [
        i
        for i, (a, b) in enumerate(zip(result.outputs["pixels"], host_outputs, strict=True))
        if (a != b).any()
    ]
    assert not bad, f"{what}: items {bad[:10]} differ from the all-host run"


@pytest.fixture(scope="module")
def run_s(images) -> float:
    """How long an undisturbed split run takes here, its agent's start included: the random
    moments fall inside it, however fast this machine is today. The second of two runs: the
    first also pays this process's one-time costs, which the trials' runs do not, and would
    put the last slices of moments after their streams have ended."""
    took = []
    for _ in range(2):
        t0 = time.perf_counter()
        result = nicoffload.run(
            PIPELINE, images, plan=split_plan("tcp"), topology=local_topology(), workers=1
        )
        took.append(time.perf_counter() - t0)
        assert result.ok.all() and result.stats.failover is None
    return took[-1]


def test_killing_the_agent_at_random_moments_loses_changes_and_doubles_nothing(
    images, host_outputs, run_s
):
    rng = random.Random(2026)
    # the first moments fall before the agent listens and while it loads its stage, the rest
    # anywhere in the first 90% of a run: one in each of TRIALS - 3 equal slices of it (so
    # that its start, load and stream are each hit, over both transports, by few trials)
    n = TRIALS - 3
    moments = [0.0, 0.05, 0.3] + [rng.uniform(k, k + 1) * 0.9 * run_s / n for k in range(n)]
    failed_over = []
    for i, delay in enumerate(moments):
        transport = "shm" if i % 2 else "tcp"
        result = run_hit_at(delay, signal.SIGKILL, images, transport)
        check(result, host_outputs, f"SIGKILL at {delay:.2f} s over {transport}")
        if result.stats.failover is not None:
            failed_over.append(result.stats.failover)
            assert result.stats.stages["s0-dpu0@host"]["ms_per_item"] > 0
    assert any("started" in why for why in failed_over)  # killed before it listened
    assert len(failed_over) >= TRIALS // 2


def test_stopping_the_agent_mid_run_drains_it_and_the_host_runs_what_it_refuses(
    images, host_outputs
):
    """SIGTERM once the stream is under way (the agent loaded, items flowing): the agent drains,
    refusing what comes after, and the host runs what it refuses."""
    reasons = []
    for at in (30, 70, 110, 150):
        with signal_local_agents_after(3600.0) as pids:  # no timer: the items decide when
            result = nicoffload.run(
                PIPELINE,
                signalling_at(pids, images, at, signal.SIGTERM),
                plan=split_plan("tcp"),
                topology=local_topology(),
                workers=1,
            )
        check(result, host_outputs, f"SIGTERM before item {at}")
        reasons.append(result.stats.failover or "")
    # the agent says it drains before it closes anything: every run it left says why
    assert any(reasons), reasons
    odd = [why for why in reasons if why and "draining" not in why]
    assert not odd, "\n".join(odd)


def signalling_at(pids: list[int], items, at: int, sig: int):
    """`items`, with `sig` sent to the run's agent just before item `at` is handed out."""
    import os

    for i, item in enumerate(items):
        if i == at:
            os.kill(pids[0], sig)
        yield item
