"""Session.run's gathering of a call's batches: rows copied out of the reused slot once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nicoffload.graph import load_pipeline
from nicoffload.runner import RunStats
from nicoffload.runtime.batch import Batch
from nicoffload.session import collect

BERT = load_pipeline(Path(__file__).resolve().parents[2] / "pipelines" / "bert.yaml")


def batches(sizes: list[int]):
    """Batches written into ONE reused slot, as the executor's are: a batch must be copied
    before the next one overwrites it."""
    slot = {k: np.zeros((max(sizes), *s.shape), s.dtype) for k, s in BERT.output_specs().items()}
    start = 0
    for i, n in enumerate(sizes):
        for a in slot.values():
            a[:n] = (start + np.arange(n)).reshape(-1, *([1] * (a.ndim - 1)))
        ok = np.ones(n, bool)
        yield Batch(
            i,
            start,
            [f"x{start + j}" for j in range(n)],
            {k: a[:n] for k, a in slot.items()},
            ok,
            [],
            np.zeros(n),
        )
        start += n


@pytest.mark.parametrize("announced", [None, 10, 7, 30])  # unknown, exact, too few, too many
def test_every_row_comes_out_once_in_order_however_many_items_were_announced(announced) -> None:
    result = collect(BERT, batches([4, 4, 2]), RunStats(), announced)
    assert result.names == [f"x{i}" for i in range(10)] and result.ok.all()
    for k, a in result.outputs.items():
        assert a.shape[0] == 10, k
        np.testing.assert_array_equal(a.reshape(10, -1)[:, 0], np.arange(10))
