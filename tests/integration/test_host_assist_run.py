"""Host assist on a real agent process: the host runs the leading DPU stage for a share of the
rows while the agent is busy, and the run is still the all-host run, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from agent_kill import run_killing_at
from equivalence import assert_same_run, corpus
from split_plans import agent_topology, plan_of, token_agent

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.inputs import sample_items
from nicoffload.planner import physical
from nicoffload.planner.plan import single_device_plan

CASES = {  # pipeline -> its nodes on the DPU (the rest on the host)
    "resnet50": ("pipelines/resnet50.yaml", {"decode", "resize", "crop", "norm"}),
    "resnet50 split": ("pipelines/resnet50.yaml", {"decode", "resize", "crop"}),
    "bert": ("pipelines/bert.yaml", {"tok"}),
}


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    with token_agent(tmp_path_factory.mktemp("agent")) as a:
        yield a


def small_batches(path: str, folder) -> nicoffload.Pipeline:
    """The pipeline with batches of 8: the agent holds a batch or more within the first few,
    so that the host shares the rows from early on."""
    doc = yaml.safe_load(Path(path).read_text())
    doc["batch"] = {"max_size": 8, "max_wait_ms": 2}
    out = folder / "p.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_pipeline(out)


def assisted_plan(pipeline, on_dpu: set[str], share: float = 0.5):
    place = {n.name: "dpu0" if n.name in on_dpu else "cpu" for n in pipeline.nodes}
    plan = physical.complete(pipeline, plan_of(pipeline, place), None)
    return physical.with_host_share(plan, share)


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_assisted_run_is_the_all_host_run_with_rows_from_both_sides(case, agent, tmp_path):
    path, on_dpu = CASES[case]
    pipeline = small_batches(path, tmp_path)
    items = corpus(pipeline, 96)
    want = nicoffload.run(pipeline, items, plan=single_device_plan(pipeline), workers=2)
    got = nicoffload.run(
        pipeline,
        items,
        plan=assisted_plan(pipeline, on_dpu),
        topology=agent_topology(agent),
        token_file=agent.token_file,
        workers=2,
    )
    assert_same_run(got, want, case)
    assert 0 < got.stats.assisted < len(items)  # rows from the host and from the agent
    assert got.stats.failover is None
    assert got.stats.to_json()["assisted"] == got.stats.assisted
    assert got.stats.stages["s0-dpu0@host"]["ms_per_item"] > 0  # the host's copy ran them


def test_an_agent_killed_during_an_assisted_run_loses_and_doubles_nothing(tmp_path):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    pipeline = small_batches("pipelines/resnet50.yaml", tmp_path)
    # good items only (every one must come out ok), named by their index
    items = [(str(i), v) for i, (_, v) in enumerate(sample_items(pipeline, 160, seed=5))]
    want = nicoffload.run(pipeline, items, plan=single_device_plan(pipeline), workers=2)
    agent = LocalAgent(token, cores=1)
    got = run_killing_at(
        agent,
        pipeline,
        items,
        80,
        plan=assisted_plan(pipeline, {"decode", "resize", "crop"}),
        topology=agent_topology(agent),
        token_file=token,
        workers=2,
    )
    assert_same_run(got, want, "killed")
    assert got.stats.assisted > 0
