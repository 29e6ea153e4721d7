"""A call's DPU stage figures are its own session's: another session of the same stage name on
the agent (another host's) working during the call is not counted in them."""

from __future__ import annotations

from split_plans import SPLIT, agent_topology, plan_of

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.runtime.remote import since
from nicoffload.samples import sample_images

PIPELINE = load_pipeline("pipelines/resnet50.yaml")


def test_another_session_working_during_a_call_is_not_in_its_figures(tmp_path):
    images = [b for _, b in sample_images(8, seed=5)]
    token = tmp_path / "agent.token"
    auth.write_token(token)
    with LocalAgent(token, cores=1) as agent:

        def open_one():
            return nicoffload.open(
                PIPELINE,
                plan_of(PIPELINE, SPLIT),
                agent_topology(agent),
                token_file=token,
                workers=1,
            )

        with open_one() as a, open_one() as b:

            def items():
                yield from images[:2]
                assert b.run(images[2:8]).ok.all()  # the other session, mid-call
                yield from images[:2]

            result = a.run(items())
            assert result.ok.all()
            dpu = next(s for s in result.stats.stages.values() if s["device"] == "dpu0")
            assert dpu["items"] == 4  # not 10
            b.close()  # its figures leave the agent's sums: not "fewer calls, all of them"
            assert a.run(images[:3]).stats.stages[dpu_name(result)]["items"] == 3


def dpu_name(result) -> str:
    return next(k for k, s in result.stats.stages.items() if s["device"] == "dpu0")


def test_since_another_session_of_the_agent_counts_from_nothing():
    before = {"session": 1, "steps": {"decode": {"cpu_ms": 2.0, "wall_ms": 2.0, "calls": 5}}}
    now = {"session": 2, "steps": {"decode": {"cpu_ms": 3.0, "wall_ms": 3.0, "calls": 7}}}
    assert since(now, before)["steps"]["decode"] == {"cpu_ms": 3.0, "wall_ms": 3.0, "calls": 7}
