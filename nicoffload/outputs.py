"""`run --output DIR`: outputs written as plain numpy files, loadable with `numpy.load`.

DIR/<output>.npy    one array per pipeline output, shape (items, *item_shape), item order;
                    rows of failed items are zero (np.load(..., mmap_mode="r") works)
DIR/items.json      [{"index", "name", "ok", "reason", "detail"}] in item order
DIR/summary.json    the `run --json` document
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.errors import Mark, UserError
from nicoffload.graph import Pipeline
from nicoffload.runtime.executor import Batch


class OutputWriter:
    """Writes batches into preallocated .npy files as they arrive (no whole-run buffering)."""

    def __init__(self, folder: str | Path, pipeline: Pipeline, count: int) -> None:
        self.folder = Path(folder)
        specs = pipeline.output_specs()
        ragged = [k for k, s in specs.items() if not s.static]
        if ragged:
            raise UserError(
                f"--output: output '{ragged[0]}' ({specs[ragged[0]]}) has a shape that varies per item; "
                "end the pipeline with a fixed-size op (center_crop, resize with size) to write it",
                Mark(pipeline.path, 1, 1),
            )
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"--output: cannot create '{folder}': {exc}", Mark(str(folder), 1, 1)
            ) from None
        self.count = count
        self.arrays = {
            k: np.lib.format.open_memmap(
                self.folder / f"{k}.npy", mode="w+", dtype=s.dtype, shape=(count, *s.shape)
            )
            for k, s in specs.items()
        }
        self.items: list[dict[str, Any]] = []

    def write(self, batch: Batch) -> None:
        end = batch.start + len(batch)
        for k, arr in self.arrays.items():
            arr[batch.start : end] = batch.outputs[k]
        failed = {f.index: f for f in batch.failures}
        for i, name in enumerate(batch.names):
            f = failed.get(batch.start + i)
            self.items.append(
                {"index": batch.start + i, "name": name, "ok": f is None}
                | ({"reason": f.reason, "detail": f.detail} if f else {})
            )

    def close(self, summary: dict[str, Any]) -> None:
        for arr in self.arrays.values():
            arr.flush()
        (self.folder / "items.json").write_text(json.dumps(self.items, indent=1) + "\n")
        (self.folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
