"""The row-status invariant, by fault injection: a row that no stage wrote (or that another
batch overwrote) never comes out as ok, and a row the agent did not deliver runs on the host."""

from __future__ import annotations

import numpy as np
import pytest

import nicoffload
from nicoffload.errors import SystemFailure
from nicoffload.runtime import buffers
from nicoffload.runtime.batch import UNWRITTEN, ItemFailure, Stamps, settle
from nicoffload.runtime.remote import DRAINING, RemoteFront
from nicoffload.runtime.stage import Stage
from nicoffload.transport.slots import Delivery

TEXTS = [f"item number {i} " * (i % 5 + 1) for i in range(40)]


def pipeline_file(tmp_path, max_size: int = 4):
    path = tmp_path / "text.yaml"
    path.write_text(
        f"""
name: text
inputs: {{text: {{kind: text}}}}
nodes:
  - {{name: tok, op: tokenize, in: text, params: {{max_length: 16}}}}
outputs: {{ids: tok.input_ids, mask: tok.attention_mask}}
batch: {{max_size: {max_size}, max_wait_ms: 10000}}
"""
    )
    return path


@pytest.fixture
def reference(tmp_path):
    result = nicoffload.run(pipeline_file(tmp_path), TEXTS, workers=2)
    assert result.ok.all()
    return result


def test_a_stage_that_skips_a_row_fails_that_item_as_unwritten(tmp_path, reference, monkeypatch):
    real = Stage.process

    def skipping(self, values, dests, *args, **kwargs):
        if values.get("text") == TEXTS[9]:
            return []  # computes nothing and writes nothing
        return real(self, values, dests, *args, **kwargs)

    monkeypatch.setattr(Stage, "process", skipping)
    result = nicoffload.run(pipeline_file(tmp_path), TEXTS, workers=2)
    assert result.ok.tolist() == [i != 9 for i in range(len(TEXTS))]
    (failure,) = result.failures
    assert failure.index == 9 and failure.reason == UNWRITTEN and "ids" in failure.detail
    assert not result.outputs["ids"][9].any()
    keep = result.ok
    np.testing.assert_array_equal(result.outputs["ids"][keep], reference.outputs["ids"][keep])


def test_a_kernel_that_ignores_its_destination_still_fills_the_row(
    tmp_path, reference, monkeypatch
):
    real = Stage.process

    def fresh_arrays(self, values, dests, *args, **kwargs):
        real(self, values, {}, *args, **kwargs)  # results left in `values`, nothing written
        return []

    monkeypatch.setattr(Stage, "process", fresh_arrays)
    result = nicoffload.run(pipeline_file(tmp_path), TEXTS, workers=2)
    assert result.ok.all()
    np.testing.assert_array_equal(result.outputs["ids"], reference.outputs["ids"])
    np.testing.assert_array_equal(result.outputs["mask"], reference.outputs["mask"])


def test_a_slot_reused_while_its_batch_is_open_never_yields_a_wrong_row_as_ok(
    tmp_path, reference, monkeypatch
):
    real_take = buffers.SlotRing.take
    shared: list[buffers.BatchSlot] = []

    def take_the_same_slot(self, timeout=None):
        if not shared:
            shared.append(real_take(self, timeout))
        else:
            shared[0].renew()  # as a real take does, though the slot is still in use
        return shared[0]

    monkeypatch.setattr(buffers.SlotRing, "take", take_the_same_slot)
    with pytest.raises(SystemFailure, match="taken by another batch"):
        nicoffload.run(pipeline_file(tmp_path), TEXTS * 4, workers=1)


def test_settle_fails_a_row_stamped_by_another_item_and_keeps_real_failures():
    stamps = Stamps(["a", "b"], 4)
    for row in range(4):
        stamps.wrote("a", row, 10 + row)
        stamps.wrote("b", row, 10 + row)
    stamps.wrote("b", 2, 99)  # another batch's item wrote row 2 of `b`
    failures = [ItemFailure(11, "x1", "corrupt", "bad jpeg")]
    ok, out = settle(10, ["x0", "x1", "x2", "x3"], failures, [stamps])
    assert ok.tolist() == [True, False, False, True]
    assert [(f.index, f.reason) for f in out] == [(11, "corrupt"), (12, UNWRITTEN)]
    assert "b" in out[1].detail


class _Client:
    alive = True

    def __init__(self) -> None:
        self.sent: list[int] = []

    def submit(self, request_id, values) -> None:
        self.sent.append(request_id)


class _Receiver:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, delivery) -> None:
        self.released.append(delivery.slot)


class _Task:
    def __init__(self, index: int) -> None:
        self.index = index
        self.values = {"text": str(index)}


def front_with(n: int) -> tuple[RemoteFront, list[_Task]]:
    from nicoffload.planner.plan import StagePlan

    stage = StagePlan("s0-dpu0", "dpu0", "dpu", ("tok",))
    front = RemoteFront(stage, _Client(), _Receiver(), ["tok.input_ids"])
    tasks = [_Task(i) for i in range(n)]
    for t in tasks:
        front.submit(t)
    return front, tasks


def delivery(ids: list[int], failed: dict | None = None) -> Delivery:
    rows = np.arange(len(ids) * 2, dtype=np.int64).reshape(len(ids), 2)
    meta = {"request_ids": ids, "failed": failed or {}}
    return Delivery(0, ids[0], len(ids), {"tok.input_ids": rows}, meta)


def test_a_delivery_missing_a_row_sends_that_item_to_the_host_exactly_once():
    front, _ = front_with(6)
    rows, on_host = [], []
    take = lambda d: front._take(  # noqa: E731
        d, lambda t, v, why, rel: rows.append(t.index), lambda ts, why: on_host.extend(ts)
    )
    take(delivery([1, 2, 4]))  # item 2 (request 3) was skipped
    assert rows == [0, 1, 3] and [t.index for t in on_host] == [2]
    take(delivery([3, 5, 6]))  # a late row for item 2 is ignored: it runs on the host only
    assert rows == [0, 1, 3, 4, 5] and [t.index for t in on_host] == [2]
    assert not front.pending


def test_rows_refused_while_the_agent_drains_run_on_the_host_and_stop_new_submits():
    front, _ = front_with(3)
    rows, on_host = [], []
    refused = {"2": [DRAINING, "the agent is shutting down"], "3": [DRAINING, "shutting down"]}
    front._take(
        delivery([1, 2, 3], refused),
        lambda t, v, why, rel: rows.append((t.index, why)),
        lambda ts, why: on_host.extend(t.index for t in ts),
    )
    assert rows == [(0, None)] and on_host == [1, 2]
    assert front.alive and not front.accepting and "draining" in front.refusing


def test_the_python_api_refuses_a_plan_for_a_device_the_topology_lacks(tmp_path):
    from nicoffload.errors import UserError
    from nicoffload.planner.plan import single_device_plan
    from nicoffload.topology import Device, Topology

    pipeline = nicoffload.load_pipeline(pipeline_file(tmp_path))
    plan = single_device_plan(pipeline, "dpu0")
    host = Topology("host", (Device("cpu", "cpu", 1, 1.0),), (), "cpu", "cpu", "host.yaml")
    with pytest.raises(UserError, match="lacks") as info:
        nicoffload.run(pipeline, TEXTS, plan=plan, topology=host)
    assert info.value.exit_code == 2
