"""A plan file's physical decisions are checked before the runtime takes them: a wrong scheme,
count or size, a missing or unknown field, an entry for no DPU stage is a PlanError naming it."""

from __future__ import annotations

import dataclasses

import pytest
from split_plans import SPLIT, plan_of

from nicoffload.errors import PlanError
from nicoffload.graph import load_pipeline
from nicoffload.planner import physical

PIPELINE = load_pipeline("pipelines/resnet50.yaml")


def _plan(**change):
    plan = physical.complete(PIPELINE, plan_of(PIPELINE, SPLIT), None)
    (name,) = plan.physical
    entry = {**plan.physical[name], **change}
    for key in [k for k, v in change.items() if v is None]:
        del entry[key]
    return dataclasses.replace(plan, physical={name: entry})


def test_a_complete_plan_passes_and_keeps_its_decisions() -> None:
    plan = _plan()
    physical.check(plan)
    assert physical.complete(PIPELINE, plan, None) is plan


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"scheme": "udp"}, "scheme 'udp' is none of tcp, shm, rdma"),
        ({"slots": 0}, "slots 0 must be an integer 1-64"),
        ({"slots": 2.5}, "slots 2.5"),
        ({"slots": True}, "slots True"),
        ({"slot_bytes": -1}, "slot_bytes -1"),
        ({"batch_max_size": "64"}, "batch_max_size '64'"),
        ({"batch_max_wait_ms": float("nan")}, "batch_max_wait_ms nan"),
        ({"batch_max_wait_ms": -1}, "batch_max_wait_ms -1"),
        ({"slots": None}, "fields"),
        ({"extra": 1}, "fields"),
    ],
)
def test_a_wrong_decision_is_refused_with_its_field(change: dict, says: str) -> None:
    with pytest.raises(PlanError, match="physical") as info:
        physical.check(_plan(**change), "my.plan.json")
    assert says in str(info.value)


def test_an_entry_for_a_stage_that_is_not_a_dpu_stage_is_refused() -> None:
    plan = _plan()
    bad = dataclasses.replace(plan, physical={**plan.physical, "s1-cpu": {}})
    with pytest.raises(PlanError, match="no DPU stage 's1-cpu'"):
        physical.complete(PIPELINE, bad, None)
