"""The DPU agent's own CPU per item (a profile's `runtime.agent_us_per_item`, and its
`agent_us_per_batch` shared by a batch's items) is priced on the DPU for every item that crosses
into or out of one of its stages: once for a stage with one input and one output, nothing for a
placement that leaves the DPU idle."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nicoffload.graph import load_pipeline
from nicoffload.planner.cost import Catalog, build_model
from nicoffload.planner.evaluate import evaluate
from nicoffload.profiles import load_profile
from nicoffload.topology import local_topology

RESNET = load_pipeline("pipelines/resnet50.yaml")


def _models(
    agent_us: float | None, ingress: str = "cpu", per_batch: float | None = None, pipeline=RESNET
):
    topology = local_topology(gpu=False, ingress=ingress)
    if "dpu0" not in topology.ids:
        pytest.skip("one core: the local topology has no emulated DPU")
    profiles = {d.id: load_profile(d.profile) for d in topology.devices}
    profiles["dpu0"] = dataclasses.replace(
        profiles["dpu0"], agent_us_per_item=agent_us, agent_us_per_batch=per_batch
    )
    return topology, build_model(pipeline, topology, profiles, Catalog.from_registry())


@pytest.mark.parametrize("batch", [64, 8])
def test_the_agents_cost_per_batch_is_shared_by_the_batchs_items(batch):
    pipeline = dataclasses.replace(RESNET, batch_max_size=batch)
    topology, with_batch = _models(80.0, per_batch=640.0, pipeline=pipeline)
    _, without = _models(80.0, pipeline=pipeline)
    dpu, cpu = topology.ids.index("dpu0"), topology.ids.index("cpu")
    split = np.array([[dpu if n != "norm" else cpu for n in with_batch.nodes]])
    a, b = evaluate(with_batch, split), evaluate(without, split)
    assert a.work[0, dpu] - b.work[0, dpu] == pytest.approx(0.640 / batch)
    assert a.work[0, cpu] == pytest.approx(b.work[0, cpu])


def test_a_dpu_stage_pays_the_agents_own_cpu_once_per_item():
    topology, with_agent = _models(80.0)
    _, without = _models(None)
    dpu, cpu = topology.ids.index("dpu0"), topology.ids.index("cpu")
    names = list(with_agent.nodes)
    split = np.array([[dpu if n != "norm" else cpu for n in names]])  # decode..crop on the DPU
    host = np.array([[cpu] * len(names)])
    a, b = evaluate(with_agent, split), evaluate(without, split)
    assert a.work[0, dpu] - b.work[0, dpu] == pytest.approx(0.080)
    assert a.work[0, cpu] == pytest.approx(b.work[0, cpu])  # the host pays none of it
    assert a.host[0] == pytest.approx(b.host[0])
    h1, h0 = evaluate(with_agent, host), evaluate(without, host)
    np.testing.assert_allclose(h1.work, h0.work)  # the DPU idle: nothing


def test_a_dpu_that_receives_the_items_pays_it_in_full_whatever_the_placement():
    topology, with_agent = _models(80.0, ingress="dpu0")
    _, without = _models(None, ingress="dpu0")
    dpu, cpu = topology.ids.index("dpu0"), topology.ids.index("cpu")
    names = list(with_agent.nodes)
    for place in ([dpu if n != "norm" else cpu for n in names], [cpu] * len(names)):
        a, b = evaluate(with_agent, np.array([place])), evaluate(without, np.array([place]))
        paid = (a.work[0, dpu] + with_agent.base[dpu]) - (b.work[0, dpu] + without.base[dpu])
        assert paid == pytest.approx(0.080), place  # received, then sent on: once
