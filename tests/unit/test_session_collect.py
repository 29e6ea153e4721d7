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


def torch_batches(sizes: list[int]):
    """The same batches with every output a torch tensor, fresh per batch, as a GPU stage
    hands them over (on the host here: `Staging` copies a host tensor without staging it)."""
    torch = pytest.importorskip("torch")
    for b in batches(sizes):
        yield Batch(
            b.index,
            b.start,
            b.names,
            {k: torch.from_numpy(a.copy()) for k, a in b.outputs.items()},
            b.ok,
            b.failures,
            b.latencies_s,
        )


@pytest.mark.parametrize("announced", [None, 10, 7, 30])
def test_tensor_outputs_come_down_batch_by_batch_and_stay_for_torch(announced) -> None:
    result = collect(BERT, torch_batches([4, 4, 2]), RunStats(), announced)
    assert result.names == [f"x{i}" for i in range(10)] and result.ok.all()
    for k, a in result.outputs.items():
        assert isinstance(a, np.ndarray) and a.shape[0] == 10, k
        np.testing.assert_array_equal(a.reshape(10, -1)[:, 0], np.arange(10))
        np.testing.assert_array_equal(result.torch()[k].numpy(), a)  # the tensors, concatenated


def test_a_tensor_of_another_shape_than_its_rows_is_an_error_not_a_broadcast() -> None:
    torch = pytest.importorskip("torch")
    from nicoffload.session import Staging

    with pytest.raises(ValueError, match="shape"):
        Staging().down(torch.zeros(1, 4), np.empty((3, 4), np.float32))


def test_a_tensor_of_another_dtype_than_its_spec_keeps_its_own() -> None:
    """Never a silent cast into the spec's dtype: the rows come out as the stage made them."""
    torch = pytest.importorskip("torch")
    batches_ = (
        Batch(
            b.index,
            b.start,
            b.names,
            {k: v.to(torch.float64) for k, v in b.outputs.items()},
            b.ok,
            b.failures,
            b.latencies_s,
        )
        for b in torch_batches([4, 2])
    )
    result = collect(BERT, batches_, RunStats(), 6)
    for k, a in result.outputs.items():
        assert a.dtype == np.float64 and a.shape[0] == 6, k
        np.testing.assert_array_equal(a.reshape(6, -1)[:, 0], np.arange(6))
