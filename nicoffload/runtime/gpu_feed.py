"""The GPU end of an executor: a plan's trailing GPU stage, fed whole batches in order.

When the tensor crossing from the host has a static shape, each batch's rows are views of a
pinned staging slot that the host workers write straight into (one copy to the device, none on
the host); otherwise each row's value is collected as the host stages (or the DPU agent's
deliveries) leave it. When a DPU stage feeds the GPU stage directly through a `GpuLanding`,
the rows arrive in GPU memory already and each batch is gathered there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from nicoffload.graph import Pipeline, TensorSpec
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.batch import Stamps


def spec_of_key(pipeline: Pipeline, key: str) -> TensorSpec:
    """The TensorSpec of a value key: a pipeline input name, `node` or `node.port`."""
    if key in pipeline.inputs:
        return pipeline.inputs[key]
    name, _, port = key.partition(".")
    return pipeline.node(name).out_specs[port or "out"]


def placeholder(spec: TensorSpec) -> Any:
    """What a failed row carries to the GPU: a tiny zero image (its result is discarded)."""
    if spec.dtype in ("bytes", "str"):
        return b"" if spec.dtype == "bytes" else ""
    return np.zeros([d if isinstance(d, int) else 1 for d in spec.shape], spec.dtype)


def zero_failed(out: dict[str, Any], ok: np.ndarray) -> dict[str, Any]:
    """`out`'s batch values (tensors, or lists of rows) with the rows not `ok` zeroed (None
    in lists), in place: a failed row never carries a partial result."""
    if ok.all():
        return out
    bad = np.flatnonzero(~ok).tolist()
    for v in out.values():
        if isinstance(v, list):
            for i in bad:
                v[i] = None
        else:
            v[bad] = 0
    return out


@dataclass
class GpuRows:
    """One batch's inputs to the GPU stage as the host fills them, row by row; `stamps` says
    which item wrote each row of each input (a row not written by its item is never ok)."""

    pinned: Any  # HostBatch of the pinned key, or None
    values: dict[str, list[Any]]
    stamps: Stamps


class GpuFeed:
    """A GPU StagePlan plus how the host hands it batches (`rows`, `collect`, `run`)."""

    def __init__(
        self,
        pipeline: Pipeline,
        plan: StagePlan,
        keep: set[str],
        stage: Any = None,
        in_place: bool = True,
    ) -> None:
        if stage is None:
            from nicoffload.runtime.gpu_stage import GpuStage

            stage = GpuStage(pipeline, plan, keep)
        self.stage = stage
        self.plan = plan
        self.inputs: list[str] = list(stage.inputs)
        self.outputs: set[str] = set(stage.outputs)
        specs = {k: spec_of_key(pipeline, k) for k in self.inputs}
        self.specs = specs
        # One pinned slot per batch: with several crossing tensors, each would hold a slot of
        # the ring and the batches in flight would starve it; those go the collecting way.
        # `in_place`: host stages produce the crossing tensor (else its rows are collected)
        static = [k for k, s in specs.items() if s.static]
        self.pinned = static[0] if len(self.inputs) == 1 and static and in_place else None

    def close(self) -> None:
        self.stage.close()

    def rows(self, size: int) -> GpuRows:
        """Room for a batch of up to `size` rows; blocks while every pinned slot is in use."""
        hb = None
        if self.pinned is not None:
            spec = self.specs[self.pinned]
            hb = self.stage.host_batch([tuple(spec.shape)] * size, np.dtype(spec.dtype))
        values = {k: [None] * size for k in self.inputs if k != self.pinned}
        return GpuRows(hb, values, Stamps(self.inputs, size))

    def dests(self, rows: GpuRows, row: int) -> dict[str, Any]:
        """Where the host stages write row `row` of the crossing tensor in place."""
        return {} if rows.pinned is None else {self.pinned: rows.pinned.arrays[row]}

    def collect(
        self, rows: GpuRows, row: int, values: Mapping[str, Any], written: set[str], index: int
    ) -> None:
        """Keep row `row`'s inputs for item `index` and stamp them: the collected ones copied
        out of the kernels' per-thread scratch, the pinned one copied into its row unless a
        host stage wrote it there in place (`written`)."""
        for k in self.inputs:
            if k not in values:
                continue  # unstamped: the row fails as unwritten
            v = values[k]
            if k == self.pinned:
                if k not in written:
                    rows.pinned.arrays[row][...] = v
            else:
                rows.values[k][row] = np.array(v, copy=True) if isinstance(v, np.ndarray) else v
            rows.stamps.wrote(k, row, index)

    def release(self, rows: GpuRows) -> None:
        """Give back the pinned slot of a batch that will never be fed."""
        if rows.pinned is not None:
            self.stage.ring.give_back(rows.pinned.slot)

    def _placeholder(self, key: str) -> Any:
        return placeholder(self.specs[key])

    def batch_inputs(self, rows: GpuRows, n: int, ok: np.ndarray) -> dict[str, Any]:
        """The GPU stage's `{input key: items}` for the first `n` rows."""
        out: dict[str, Any] = {}
        if rows.pinned is not None:
            hb = rows.pinned
            end = hb.offsets[n - 1] + hb.arrays[n - 1].nbytes
            out[self.pinned] = replace(hb, arrays=hb.arrays[:n], offsets=hb.offsets[:n], nbytes=end)
        for k, vals in rows.values.items():
            if any(hasattr(v, "is_cuda") for v in vals[:n]):
                out[k] = self._gathered(k, vals[:n], ok)
                continue
            out[k] = [
                v if ok[i] and v is not None else self._placeholder(k)
                for i, v in enumerate(vals[:n])
            ]
        return out

    def _gathered(self, key: str, vals: list[Any], ok: np.ndarray) -> Any:
        """Rows landed in GPU memory as one batch there: a (n, ...) tensor for a static shape,
        else a list. Rows the host computed instead (items taken back from a dead agent) are
        copied up; failed rows are zeros. Waits for the gathering copies, so that the stage's
        own streams find the batch complete."""
        gpu = self.stage.gpu
        torch, spec = gpu.torch, self.specs[key]
        rows = []
        for i, v in enumerate(vals):
            if not ok[i] or v is None:
                v = self._placeholder(key)
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v)
            rows.append(v.to(gpu.device))
        batch = torch.stack(rows) if spec.static else rows
        torch.cuda.current_stream(gpu.device).synchronize()
        return batch

    def run(self, batches: Iterable[Mapping[str, Any]]) -> Iterator[Any]:
        """The stage's finished GpuBatches, in order."""
        return self.stage.stream(batches)

    def outputs_of(self, gb: Any, ok: np.ndarray, refs: Mapping[str, str]) -> dict[str, Any]:
        """A finished batch's outputs by output name (CUDA tensors); failed rows zeroed."""
        out = {name: gb.outputs[ref] for name, ref in refs.items() if ref in gb.outputs}
        return zero_failed(out, ok)

    def begin_call(self) -> None:
        self.stage.begin_call()

    def step_ms_per_item(self) -> dict[str, float]:
        return self.stage.step_ms_per_item()

    @property
    def step_names(self) -> list[str]:
        return [s.name for s in self.stage.steps]
