"""The agent's per-batch bookkeeping answers as its per-item form did: a frame's ids admitted
at once (SeenIds.add_range), a worker's items recorded at once (Metrics.items)."""

from __future__ import annotations

import random

import pytest

from dpu_agents.metrics import Metrics
from dpu_agents.seen import SeenIds


@pytest.mark.parametrize("span", [1, 7, 64, 1000])
def test_add_range_is_add_of_each_id(span: int) -> None:
    rng = random.Random(span)
    one, many = SeenIds(span), SeenIds(span)
    at = 0
    for _ in range(400):
        first = max(0, at + rng.randint(-span - 3, 2 * span + 3))
        n = rng.randint(1, 2 * span + 2)
        want = [one.add(rid) for rid in range(first, first + n)]
        assert many.add_range(first, n) == want, (first, n)
        assert (many.high, many._bits) == (one.high, one._bits)
        at = max(at, first + n)


def test_items_counts_as_item_does_for_each() -> None:
    each, batch = Metrics(), Metrics()
    times = [0.001, 0.002, 0.004]
    for t, ok in zip(times, [True, False, True], strict=True):
        each.item("s", t, ok)
    batch.items("s", times, 1)
    assert each.snapshot() == batch.snapshot()
