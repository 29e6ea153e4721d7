"""A session's call reports its own figures: a stage's step times count from the call's start
(`Stage.begin_call`), and the agent's lifetime figures less what it had counted when the call
began (`remote.since`)."""

from __future__ import annotations

import pytest

from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.runtime.remote import since
from nicoffload.runtime.stage import Stage
from nicoffload.samples import sample_images

PIPELINE = load_pipeline("pipelines/resnet50.yaml")


def agent_doc(**steps: tuple[float, float, int]) -> dict:
    return {"steps": {k: {"cpu_ms": c, "wall_ms": w, "calls": n} for k, (c, w, n) in steps.items()}}


def test_since_gives_the_means_of_the_calls_after_the_snapshot():
    before = agent_doc(decode=(2.0, 3.0, 10), resize=(1.0, 1.0, 10))
    now = agent_doc(decode=(3.0, 4.0, 30), resize=(1.0, 2.0, 25))
    got = since(now, before)
    # decode: (3*30 - 2*10) / 20 = 3.5 cpu, (4*30 - 3*10) / 20 = 4.5 wall; resize's wall
    # (2*25 - 1*10) / 15
    assert got["steps"]["decode"] == pytest.approx({"cpu_ms": 3.5, "wall_ms": 4.5, "calls": 20})
    assert got["steps"]["resize"] == pytest.approx({"cpu_ms": 1.0, "wall_ms": 40 / 15, "calls": 15})
    assert got["cpu_ms_per_item"] == pytest.approx(4.5)
    assert got["wall_ms_per_item"] == pytest.approx(4.5 + 40 / 15)
    assert got["items"] == 20


def test_since_nothing_before_is_everything_and_no_calls_since_is_zero():
    now = agent_doc(decode=(3.0, 4.0, 30))
    assert since(now, {})["steps"]["decode"] == pytest.approx(
        {"cpu_ms": 3.0, "wall_ms": 4.0, "calls": 30}
    )
    assert since(now, now)["steps"]["decode"] == {"cpu_ms": 0.0, "wall_ms": 0.0, "calls": 0}
    # fewer calls than before: another session's figures (the agent was restarted): all of them
    assert since(now, agent_doc(decode=(1.0, 1.0, 50)))["items"] == 30


def test_since_an_agent_that_does_not_count_calls_per_step_gives_its_figures_as_they_are():
    old = {"cpu_ms_per_item": 2.0, "steps": {"decode": {"cpu_ms": 2.0, "wall_ms": 2.5}}}
    assert since(old, old) is old


def test_a_stages_times_count_from_the_start_of_the_call():
    plan = single_device_plan(PIPELINE, "cpu")
    stage = Stage(PIPELINE, plan.stages[0], set())
    images = [b for _, b in sample_images(5, seed=2)]

    def run(items):
        for b in items:
            stage.process({"image": b}, {})

    run(images[:3])
    assert {t.calls for t in stage.times().values()} == {3}
    stage.begin_call()
    assert {t.calls for t in stage.times().values()} == {0}
    assert all(t.cpu_ms == 0.0 for t in stage.times().values())
    run(images[3:])
    times = stage.times()
    assert {t.calls for t in times.values()} == {2} and all(t.cpu_ms > 0 for t in times.values())
