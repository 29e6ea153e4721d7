"""A PyTorch `IterableDataset` over a Session: ready batches for a training or inference loop.

    with nicoffload.open("pipelines/resnet50.yaml") as session:
        loader = torch.utils.data.DataLoader(session.dataset(items), batch_size=None)
        for batch in loader:
            model(batch["pixels"][batch["ok"]])

The session forms the batches (its `batch: max_size`), so the DataLoader must not batch again
(`batch_size=None`) and needs no workers of its own (the session has them). Outputs of a GPU
stage stay on the GPU; the others are copied out of the session's reused slots into tensors
the loop may keep.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def dataset(session: Any, items: Iterable[Any]) -> Any:
    """An IterableDataset yielding, per batch, `{output: tensor or list of tensors, "ok": bool
    tensor, "names": [item names]}`. Iterating it again runs `items` again (a new call)."""
    try:
        import torch
        from torch.utils.data import IterableDataset
    except ImportError as exc:
        from nicoffload.errors import MissingDependency

        raise MissingDependency("torch", "gpu", "Session.dataset()") from exc

    def tensor(v: Any) -> Any:
        if hasattr(v, "is_cuda"):
            return v  # a GPU stage's output: fresh per batch already
        return torch.from_numpy(v.copy())

    class Batches(IterableDataset):
        def __iter__(self) -> Iterator[dict[str, Any]]:
            if torch.utils.data.get_worker_info() is not None:
                raise RuntimeError(
                    "Session.dataset(): give the DataLoader num_workers=0 (the session runs "
                    "its own workers; a DataLoader worker would run every item again)"
                )
            for batch in session.stream(items):
                out: dict[str, Any] = {}
                for name, v in batch.outputs.items():
                    out[name] = (
                        [None if x is None else tensor(x) for x in v]
                        if isinstance(v, list)
                        else tensor(v)
                    )
                out["ok"] = torch.from_numpy(batch.ok.copy())
                out["names"] = list(batch.names)
                yield out

    return Batches()
