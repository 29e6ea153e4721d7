"""Text items the shipped corpora do not hold, tokenized on an agent (kernels in threads, and in
worker processes) give the all-host run's rows and status: a lone surrogate fails its item alone
as bad_text (with worker processes it raised while its chunk was copied to the worker, the
chunk's rows were never finished and the host waited for ever), and bytes given for a text
input are read as utf-8 as on the host (the agent refused them as bad_request)."""

from __future__ import annotations

import numpy as np
import pytest
from split_plans import agent_topology, plan_of

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.planner.plan import single_device_plan

PIPELINE = nicoffload.load_pipeline("pipelines/bert.yaml")
# the surrogate sits between texts of its own frame: the rows after it in its batch were lost
ITEMS = ["hello", "abc\udcffdef", "more", "text", b"utf-8 \xc3\xa9", b"\xff\xfe no utf-8", "end"]


@pytest.mark.parametrize("processes", ["off", "on"])
def test_odd_texts_on_an_agent_equal_the_all_host_run(processes, tmp_path):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    want = nicoffload.run(PIPELINE, ITEMS, plan=single_device_plan(PIPELINE, "cpu"))
    assert want.ok.tolist() == [True, False, True, True, True, False, True]
    with LocalAgent(token, cores=1, worker_processes=processes) as agent:
        topo = agent_topology(agent)
        plan = plan_of(PIPELINE, {"tok": "dpu0"})
        with nicoffload.open(PIPELINE, plan, topo, token_file=token, workers=1) as session:
            got = session.submit(ITEMS).result(timeout=60)  # it hung with worker processes
    assert got.ok.tolist() == want.ok.tolist()
    assert [(f.index, f.reason) for f in got.failures] == [(1, "bad_text"), (5, "bad_text")]
    assert got.stats.failover is None
    for k, v in want.outputs.items():
        np.testing.assert_array_equal(got.outputs[k], v)
