"""A text with a lone surrogate (a str no UTF-8 encoder takes) fails its item alone as bad_text,
in every placement of the tokenizer: on the host, on the agent behind the fast path, and on the
agent after host stages (the general path); the other items equal the all-host run."""

from __future__ import annotations

import numpy as np
import pytest

import nicoffload
from nicoffload.inputs import sample_items
from nicoffload.planner import plan_placement
from nicoffload.topology import local_topology

PIPELINE = nicoffload.load_pipeline("pipelines/clip.yaml")


def _items():
    items = list(sample_items(PIPELINE, 5, seed=1))
    bad = dict(items[0][1])
    bad["text"] = "abc\udcffdef"
    items.insert(2, ("bad", bad))
    return items


@pytest.mark.parametrize(
    "on_dpu",
    [(), ("decode", "tok"), ("tok",), ("crop", "norm", "tok")],
    ids=["all host", "fast path", "general path", "after host stages"],
)
def test_a_lone_surrogate_fails_its_item_alone(on_dpu: tuple[str, ...]) -> None:
    topo = local_topology(gpu=False)
    items = _items()
    host = nicoffload.run(
        PIPELINE,
        items,
        plan=plan_placement(PIPELINE, {n.name: "cpu" for n in PIPELINE.nodes}, topo),
    )
    assert host.ok.tolist() == [True, True, False, True, True, True]
    assert [(f.index, f.reason) for f in host.failures] == [(2, "bad_text")]
    place = {n.name: "dpu0" if n.name in on_dpu else "cpu" for n in PIPELINE.nodes}
    with nicoffload.open(PIPELINE, plan_placement(PIPELINE, place, topo), topo) as s:
        for _ in range(2):  # and the session goes on
            got = s.run(items)
            assert got.ok.tolist() == host.ok.tolist()
            assert [(f.index, f.reason) for f in got.failures] == [(2, "bad_text")]
            for k, v in host.outputs.items():
                np.testing.assert_array_equal(got.outputs[k][got.ok], v[host.ok])
            assert got.stats.failover is None
