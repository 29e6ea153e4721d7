"""Rows a DPU agent delivered that are a run's outputs themselves (no host or GPU stage after
its stage): placed into their batches' output rows and stamped a batch at once, one copy per
output and batch (no per-row Python for static outputs; ragged ones are rows anyway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def delivers_outputs(front: Any, host_stages: Sequence[Any], gpu: Any, out_refs: Mapping) -> bool:
    """Whether `front`'s delivered rows hold every output, with nothing to run after them."""
    return (
        front is not None
        and not host_stages
        and gpu is None
        and set(out_refs.values()) <= set(front.keys)
    )


def place_rows(
    tasks: Sequence[Any], rows: Sequence[int], tensors: Mapping[str, Any], out_refs: Mapping
) -> list[tuple[Any, int]]:
    """Copy each task's delivered row (`rows`, indexes into `tensors`) into its batch's output
    rows (`task.batch.slot`, row `task.row`) and stamp it with the task's item; returns
    (batch, rows placed) for each batch. A value missing from the delivery is left unstamped:
    its row fails as unwritten, never comes out as ok."""
    groups: dict[int, tuple[Any, list[int], list[int], list[int]]] = {}
    for task, row in zip(tasks, rows, strict=True):
        g = groups.get(id(task.batch))
        if g is None:
            g = groups[id(task.batch)] = (task.batch, [], [], [])
        g[1].append(task.row)
        g[2].append(row)
        g[3].append(task.index)
    for b, here, there, index in groups.values():
        _place(b, here, there, b.key + 1 + np.asarray(index, np.int64), tensors, out_refs)
    return [(g[0], len(g[1])) for g in groups.values()]


def _place(b: Any, here: list[int], there: list[int], stamp: np.ndarray, tensors, out_refs):
    slot = b.slot
    h, d = np.asarray(here, np.intp), np.asarray(there, np.intp)
    n = len(here)
    runs = n and here[-1] - here[0] == n - 1 == there[-1] - there[0]  # both consecutive?
    for name, ref in out_refs.items():
        sink = slot.stamps.rows[name]
        if name in slot.arrays and ref in tensors:
            dst, src = slot.arrays[name], tensors[ref]
            if runs and (np.diff(h) == 1).all() and (np.diff(d) == 1).all():
                dst[here[0] : here[0] + n] = src[there[0] : there[0] + n]
            else:
                dst[h] = src[d]
            sink[h] = stamp
            continue
        for i, (hr, dr) in enumerate(zip(here, there, strict=True)):
            v = tensors[ref][dr] if ref in tensors else tensors.get(f"{ref}@{dr}")
            if v is None:
                continue
            if name in slot.arrays:
                slot.arrays[name][hr] = v
            else:
                slot.ragged[name][hr] = np.array(v, copy=True)
            sink[hr] = stamp[i]
