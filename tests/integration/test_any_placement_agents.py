"""Placements the fast path does not run, through real agent processes: several DPU stages
(on one DPU, each its own session, or on two), a DPU stage after host stages (it reads the
host's tensors), DPU -> host -> DPU; each equal to the all-host run bit for bit, row status
included, and an agent killed mid-run has its rows run on the host, counted and reported."""

from __future__ import annotations

import dataclasses
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
from equivalence import assert_same_run, corpus, pinned
from split_plans import plan_of

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.planner.plan import single_device_plan
from nicoffload.runner import RunStats
from nicoffload.runtime.chain import Chain, fast_path
from nicoffload.session import collect
from nicoffload.topology import Device, Link, Topology

CLIP = "pipelines/clip.yaml"  # topological order: decode, tok, resize, crop, norm


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """Two agent processes, as dpu0 and dpu1, sharing one token."""
    token = tmp_path_factory.mktemp("agents") / "agent.token"
    auth.write_token(token)
    with LocalAgent(token, cores=1) as a, LocalAgent(token, cores=1) as b:
        yield token, [a, b]


def topology(agents) -> Topology:
    """The host CPU and the agents as real DPUs dpu0, dpu1, over tcp."""
    dpus = [Device(f"dpu{i}", "dpu", 1, 1.0, address=a.address) for i, a in enumerate(agents)]
    links = [Link(d.id, "cpu", "tcp", 1e9, 0.0, 0.0) for d in dpus]
    cpu = Device("cpu", "cpu", 1, 1.0)
    return Topology("test", (cpu, *dpus), tuple(links), ingress="cpu", egress="cpu", source="test")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    pipeline = pinned(CLIP, {}, tmp_path_factory.mktemp("clip"), "clip")
    return pipeline, corpus(pipeline, 40)


@pytest.fixture(scope="module")
def want(clip):
    pipeline, items = clip
    got = nicoffload.run(pipeline, items, plan=single_device_plan(pipeline), workers=2)
    assert not got.ok.all() and got.ok.sum() >= 40
    return got


def place(decode, tok, resize, crop, norm) -> dict[str, str]:
    return {"decode": decode, "tok": tok, "resize": resize, "crop": crop, "norm": norm}


SHAPES = {
    # the second DPU stage reads the host's copy of what the first one decoded
    "dpu -> cpu -> dpu -> cpu": place("dpu0", "cpu", "dpu0", "dpu0", "cpu"),
    "cpu -> dpu -> cpu": place("cpu", "cpu", "dpu0", "dpu0", "cpu"),  # the host's tensors
    "cpu -> dpu -> cpu (inputs)": place("cpu", "dpu0", "cpu", "cpu", "cpu"),
    "dpu -> dpu (two DPUs)": place("dpu0", "dpu0", "dpu1", "dpu1", "dpu1"),
    "dpu -> cpu -> dpu (two DPUs)": place("dpu0", "cpu", "dpu1", "dpu1", "dpu1"),
    "cpu -> dpu": place("cpu", "cpu", "cpu", "dpu1", "dpu1"),
}


@pytest.mark.parametrize("what", list(SHAPES))
def test_a_placement_of_any_shape_equals_the_all_host_run(clip, want, agents, what) -> None:
    pipeline, items = clip
    token, procs = agents
    plan = plan_of(pipeline, SHAPES[what])
    assert not fast_path(plan)
    with nicoffload.open(pipeline, plan, topology(procs), token_file=token, workers=2) as s:
        assert isinstance(s.executor, Chain)
        assert set(s.fronts) == {st.name for st in plan.stages if st.kind == "dpu"}
        for _ in range(2):  # the fronts serve every call of the session
            got = s.run(items)
            assert got.stats.failover is None, what
            assert_same_run(got, want, what)
            for st in plan.stages:
                if st.kind == "dpu":
                    assert got.stats.stages[st.name]["device"] == st.device
                    assert s.fronts[st.name].transfer.items > 0  # served by its agent


def test_two_stages_on_one_emulated_dpu_share_its_one_agent(clip, want, monkeypatch) -> None:
    """The local topology's dpu0: its agent is started once, each stage a session of its own."""
    from nicoffload.topology import local_topology

    pipeline, items = clip
    started = []
    real = LocalAgent.__init__

    def counting(self, *a, **k):
        started.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(LocalAgent, "__init__", counting)
    topo = local_topology(gpu=False)
    if "dpu0" not in topo.ids:
        pytest.skip("one core: no emulated DPU")
    plan = plan_of(pipeline, SHAPES["dpu -> cpu -> dpu -> cpu"], topology="local")
    with nicoffload.open(pipeline, plan, topo, workers=2) as s:
        got = s.run(items)
        dead = {k: f.dead for k, f in s.fronts.items() if f.dead}
        clients = [f.client for f in s.fronts.values()]
    assert not dead, dead
    assert len(started) == 1 and len(clients) == 2 and clients[0] is not clients[1]
    assert got.stats.failover is None
    assert_same_run(got, want, "one emulated DPU, two stages")


def repeated(result, times: int) -> SimpleNamespace:
    """What `assert_same_run` compares of the all-host run of `times` copies of `result`'s
    items: its rows `times` over (an item's outputs are its own, whatever else its batch
    holds)."""
    n = len(result.names)
    outputs = {
        k: np.concatenate([v] * times) if isinstance(v, np.ndarray) else list(v) * times
        for k, v in result.outputs.items()
    }
    failures = [
        dataclasses.replace(f, index=f.index + k * n) for k in range(times) for f in result.failures
    ]
    return SimpleNamespace(names=list(result.names) * times, ok=np.tile(result.ok, times),
                           failures=failures, outputs=outputs)  # fmt: skip


def test_an_agent_killed_mid_run_has_its_rows_run_on_the_host(clip, want, tmp_path) -> None:
    pipeline, few = clip
    items = few * 8  # batches enough that the second agent has some in flight when it dies
    want = repeated(want, 8)
    token = tmp_path / "agent.token"
    auth.write_token(token)
    plan = plan_of(pipeline, SHAPES["dpu -> cpu -> dpu (two DPUs)"])
    with (
        LocalAgent(token, cores=1) as a,
        LocalAgent(token, cores=1) as b,
        nicoffload.open(pipeline, plan, topology([a, b]), token_file=token, workers=2) as s,
    ):

        def killing(batches):
            for i, batch in enumerate(batches):
                if i == 0:  # the second DPU stage's agent dies with batches in flight
                    os.kill(b.pid, signal.SIGKILL)
                yield batch

        stats = RunStats()
        first = collect(pipeline, killing(s.stream(items, stats)), stats)
        assert "ran stage" in (first.stats.failover or "")
        assert s.executor.taken_back > 0
        again = s.run(items)  # the next call runs that stage on the host from the start
    assert_same_run(first, want, "the agent killed mid-run")
    assert_same_run(again, want, "after the agent died")
    assert "ran stage" in (again.stats.failover or "")
