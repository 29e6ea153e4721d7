"""Session.dataset: a PyTorch IterableDataset of ready batches (needs torch: the gpu extra)."""

from __future__ import annotations

import numpy as np
import pytest

import nicoffload

torch = pytest.importorskip("torch", reason="Session.dataset needs torch (pip install '.[gpu]')")

TEXTS = [f"sentence number {i}" for i in range(21)]


def pipeline_file(tmp_path):
    path = tmp_path / "text.yaml"
    path.write_text(
        """
name: text
inputs: {text: {kind: text}}
nodes:
  - {name: tok, op: tokenize, in: text, params: {max_length: 8}}
outputs: {ids: tok.input_ids}
batch: {max_size: 4, max_wait_ms: 10000}
"""
    )
    return path


def test_a_dataloader_over_a_session_yields_its_batches_as_tensors_the_loop_may_keep(tmp_path):
    want = nicoffload.run(pipeline_file(tmp_path), TEXTS)
    with nicoffload.open(pipeline_file(tmp_path)) as session:
        loader = torch.utils.data.DataLoader(session.dataset(TEXTS), batch_size=None)
        kept = list(loader)  # held past the next batch: copies, not views of reused slots
        again = list(loader)  # a second epoch is a second call
    assert [len(b["names"]) for b in kept] == [4, 4, 4, 4, 4, 1]
    ids = torch.cat([b["ids"] for b in kept]).numpy()
    np.testing.assert_array_equal(ids, want.outputs["ids"])
    assert all(b["ok"].all() for b in kept)
    np.testing.assert_array_equal(torch.cat([b["ids"] for b in again]).numpy(), ids)


def test_a_dataloader_with_workers_of_its_own_is_refused(tmp_path):
    with nicoffload.open(pipeline_file(tmp_path)) as session:
        loader = torch.utils.data.DataLoader(session.dataset(TEXTS), batch_size=None, num_workers=1)
        with pytest.raises(RuntimeError, match="num_workers=0"):
            list(loader)
