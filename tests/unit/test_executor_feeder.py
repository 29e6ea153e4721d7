"""The executor's feeder ends with its call, whatever ends the call: it never waits for an
item without seeing that the call stopped."""

from __future__ import annotations

import threading
import time

import pytest

import nicoffload
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan

BERT = load_pipeline("pipelines/bert.yaml")


def feeders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nicoffload-feeder" and t.is_alive()]


def items_then_raise():
    yield {"text": "a first item"}
    time.sleep(0.05)  # its batch closes (max wait): the feeder then has no batch open
    raise ValueError("the caller's iterator failed")


def test_a_callers_iterator_that_raises_leaves_no_feeder_behind():
    before = len(feeders())
    with nicoffload.open(BERT, single_device_plan(BERT)) as session:
        for _ in range(3):
            with pytest.raises(ValueError, match="iterator failed"):
                session.run(items_then_raise())
            assert len(feeders()) == before  # joined when the call ended
        assert session.run(["one more"]).ok.all()  # and the session goes on
