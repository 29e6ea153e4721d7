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

    def submit_batch(self, first_id, items) -> None:
        self.sent.extend(range(first_id, first_id + len(items)))


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
        d,
        lambda ts, rs, tensors, bad, rel: rows.extend(t.index for t in ts),
        lambda ts, why: on_host.extend(ts),
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
        lambda ts, rs, tensors, bad, rel: rows.extend([(t.index, None) for t in ts] + bad),
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


class _Open:
    def __init__(self, slot, key: int) -> None:
        self.slot, self.key = slot, key


class _Row:
    def __init__(self, batch, row: int, index: int) -> None:
        self.batch, self.row, self.index = batch, row, index


def delivered_slot(rows: int) -> buffers.BatchSlot:
    arrays = {"ids": np.zeros((rows, 2), np.int64)}
    return buffers.BatchSlot(0, arrays, {"words": [None] * rows}, Stamps(["ids", "words"], rows))


def test_delivered_rows_are_placed_a_batch_at_once_each_into_its_own_row():
    from nicoffload.runtime.delivered import place_rows

    a, b = _Open(delivered_slot(4), 1 << 32), _Open(delivered_slot(4), 1 << 32)
    # rows 0, 1, 3 of the delivery; the host rows are out of order and in two batches
    tasks = [_Row(a, 2, 10), _Row(b, 0, 20), _Row(a, 0, 8)]
    tensors = {"ids": np.arange(8).reshape(4, 2) + 100, "words@0": np.array([5]), "words@3": [7]}
    placed = place_rows(tasks, [0, 1, 3], tensors, {"ids": "ids", "words": "words"})
    assert [(g is a, n) for g, n in placed] == [(True, 2), (False, 1)]
    assert a.slot.arrays["ids"][[2, 0]].tolist() == [[100, 101], [106, 107]]
    assert b.slot.arrays["ids"][0].tolist() == [102, 103]
    key = 1 << 32
    assert a.slot.stamps.rows["ids"][[2, 0]].tolist() == [key + 11, key + 9]
    assert a.slot.stamps.rows["words"][[2, 0]].tolist() == [key + 11, key + 9]
    # the delivery held no words for row 1: that row is left unstamped, so it fails as unwritten
    assert b.slot.stamps.rows["ids"][0] == key + 21 and b.slot.stamps.rows["words"][0] == 0
    ok, failures = settle(20, ["x"], [], [b.slot.stamps], key)
    assert not ok[0] and failures[0].reason == UNWRITTEN


def test_a_consecutive_delivery_lands_in_its_batch_rows_in_one_copy():
    from nicoffload.runtime.delivered import place_rows

    a = _Open(delivered_slot(4), 0)
    tensors = {"ids": np.arange(8).reshape(4, 2), **{f"words@{r}": [r] for r in range(4)}}
    tasks = [_Row(a, r + 1, r) for r in range(3)]
    place_rows(tasks, [1, 2, 3], tensors, {"ids": "ids", "words": "words"})
    assert a.slot.arrays["ids"][1:].tolist() == [[2, 3], [4, 5], [6, 7]]
    assert a.slot.stamps.rows["ids"].tolist() == [0, 1, 2, 3]
    assert [a.slot.ragged["words"][r].tolist() for r in (1, 2, 3)] == [[1], [2], [3]]
