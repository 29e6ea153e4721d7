"""The agent's kernels in worker processes (`worker_processes = "on"`): every placement of the
shipped pipelines gives the all-host run's outputs bit for bit (outputs of varying shape too:
a decode whose image leaves the agent), a worker process killed mid-run fails only the rows it
held and is started again, and nothing is left behind when the agent stops.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from equivalence import assert_same_run, corpus, pinned
from split_plans import agent_topology, run_on_agent

from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.local import LocalAgent
from nicoffload.errors import PlanError
from nicoffload.planner import plan_for
from nicoffload.planner.plan import single_device_plan
from nicoffload.procstat import child_pids

SHIPPED = ["pipelines/resnet50.yaml", "pipelines/bert.yaml", "pipelines/clip.yaml"]


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("nicoffload-*")}


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    token = tmp_path_factory.mktemp("agent") / "agent.token"
    auth.write_token(token)
    with LocalAgent(token, cores=2, worker_processes="on") as a:
        a.token_file = token
        yield a


run = run_on_agent


def workers_of(agent) -> list[int]:
    return [
        pid
        for pid in child_pids(agent.pid)
        if b"dpu_agents.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def stats(agent) -> dict:
    with AgentClient(agent.address, auth.read_token(agent.token_file)) as c:
        return c.stats()


def test_the_agent_runs_its_kernels_in_one_process_per_core(agent):
    assert stats(agent)["pool"]["kind"] == "processes"
    assert len(workers_of(agent)) == 2


@pytest.mark.parametrize("path", SHIPPED)
def test_every_placement_equals_the_all_host_run(path, tmp_path, agent):
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 40)
    want = run(pipeline, items, single_device_plan(pipeline, "cpu"), agent)
    assert want.ok.sum() >= 40
    topo = agent_topology(agent)
    names = [n.name for n in pipeline.nodes]
    ran = 0
    for kinds in itertools.product(("cpu", "dpu"), repeat=len(names)):
        if "dpu" not in kinds:
            continue
        pins = dict(zip(names, kinds, strict=True))
        try:
            plan = plan_for(pinned(path, pins, tmp_path, "-".join(kinds)), topo)
        except PlanError:
            continue
        got = run(pipeline, items, plan, agent)
        assert got.stats.failover is None, pins
        assert_same_run(got, want, f"{path} {pins}")
        ran += 1
    assert ran >= 1


def test_a_killed_worker_process_fails_only_its_rows_and_is_started_again(tmp_path, agent):
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 400)
    want = run(pipeline, items, single_device_plan(pipeline, "cpu"), agent)
    names = [n.name for n in pipeline.nodes]
    pins = {n: ("dpu" if i < 3 else "cpu") for i, n in enumerate(names)}
    plan = plan_for(pinned(path, pins, tmp_path, "split"), agent_topology(agent))
    before = stats(agent)["pool"]["restarts"]
    victim = workers_of(agent)[0]

    def kill_soon() -> None:
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)

    import threading

    t = threading.Thread(target=kill_soon)
    t.start()
    got = run(pipeline, items, plan, agent)
    t.join()
    # what the agent could not compute the host computed: the same outputs, bit for bit
    assert_same_run(got, want, "a worker process killed")
    deadline = time.monotonic() + 30
    while stats(agent)["pool"]["restarts"] == before and time.monotonic() < deadline:
        run(pipeline, items[:8], plan, agent)
    assert stats(agent)["pool"]["restarts"] > before
    assert victim not in workers_of(agent)
    again = run(pipeline, items, plan, agent)
    assert_same_run(again, want, "after the restart")
    assert np.array_equal(again.ok, want.ok)


def test_nothing_is_left_behind_when_the_agent_stops(tmp_path):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    before = segments()
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    with LocalAgent(token, cores=2, worker_processes="on") as a:
        a.token_file = token
        pins = {n.name: "dpu" for n in pipeline.nodes}
        plan = plan_for(pinned(path, pins, tmp_path, "all"), agent_topology(a))
        got = run(pipeline, corpus(pipeline, 20), plan, a)
        assert got.ok.sum() >= 18
        workers = workers_of(a)
        assert len(workers) == 2
    for pid in workers:
        assert (
            not Path(f"/proc/{pid}").exists()
            or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
        )
    assert segments() <= before


def test_a_stopped_worker_process_is_killed_after_worker_timeout_s_and_its_rows_run_on_host(
    tmp_path,
):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    config = tmp_path / "agent.toml"
    config.write_text("worker_timeout_s = 2.0\n")
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 200)
    with LocalAgent(token, cores=2, worker_processes="on", config=config) as a:
        a.token_file = token
        want = run(pipeline, items, single_device_plan(pipeline, "cpu"), a)
        pins = {n.name: "dpu" for n in pipeline.nodes}
        plan = plan_for(pinned(path, pins, tmp_path, "all"), agent_topology(a))
        run(pipeline, items[:8], plan, a)  # the kernels in numba's cache
        victim = workers_of(a)[0]
        os.kill(victim, signal.SIGSTOP)  # before the LOAD: the others build it, and run
        try:
            got = run(pipeline, items, plan, a)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        assert_same_run(got, want, "a worker process stopped")
        assert got.stats.failover is None
        assert stats(a)["pool"]["restarts"] >= 1
        assert victim not in workers_of(a)
        assert_same_run(run(pipeline, items, plan, a), want, "after it was restarted")
