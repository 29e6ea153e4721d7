"""The general path (`runtime.chain`) runs stage sequences the fast path does not: a GPU stage
followed by host stages, several GPU stages, host -> GPU -> host. Here a GPU stage is a
stand-in with `GpuStage`'s interface that runs the CPU kernels a batch at a time, so the
outputs and row status must equal the all-host run bit for bit."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from split_plans import plan_of

from nicoffload.errors import ItemError, SystemFailure
from nicoffload.graph import load_pipeline
from nicoffload.inputs import sample_items
from nicoffload.planner.physical import leaving
from nicoffload.planner.plan import single_device_plan
from nicoffload.runtime.chain import Chain, executor_for, fast_path
from nicoffload.runtime.executor import Executor
from nicoffload.runtime.stage import Stage
from nicoffload.runtime.work import stage_reads

CLIP = "pipelines/clip.yaml"


@dataclass
class _Done:
    n: int
    outputs: dict[str, Any]
    failures: dict[int, ItemError]
    produced: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


class CpuBatchStage:
    """A GPU stage's interface (`inputs`, `outputs`, `stream`, `step_ms_per_item`, `close`)
    over the CPU kernels: each batch row by row, static outputs stacked as one batch array; a
    row given None (failed before, on a GPU) is skipped, as the GPU kernels skip it."""

    def __init__(self, pipeline, plan) -> None:
        keys = leaving(pipeline, plan)
        self.stage = Stage(pipeline, replace(plan, device="cpu", kind="cpu"), set(keys))
        self.inputs, self.outputs = stage_reads(pipeline, plan.nodes), keys
        self.pipeline = pipeline
        self.batches = 0
        self.closed = False

    def _spec(self, key):
        name, _, port = key.partition(".")
        return self.pipeline.node(name).out_specs[port or "out"]

    def stream(self, batches):
        for b in batches:
            n = len(b[self.inputs[0]])
            rows: dict[str, list] = {k: [None] * n for k in self.outputs}
            failures = {}
            produced = np.ones(n, bool)
            for i in range(n):
                values = {k: b[k][i] for k in self.inputs}
                if any(v is None for v in values.values()):  # skipped, as a GPU kernel does
                    produced[i] = False
                    continue
                try:
                    self.stage.process(values, {})
                except ItemError as exc:
                    failures[i] = exc
                    continue
                for k in self.outputs:
                    rows[k][i] = np.array(values[k], copy=True)
            out = {}
            for k, col in rows.items():
                spec = self._spec(k)
                if spec.static:
                    a = np.zeros((n, *spec.shape), spec.dtype)
                    for i, v in enumerate(col):
                        if v is not None:
                            a[i] = v
                    out[k] = a
                else:
                    out[k] = col
            self.batches += 1
            yield _Done(n, out, failures, produced)

    def begin_call(self) -> None:
        pass

    def step_ms_per_item(self) -> dict[str, float]:
        return {"all": 0.0}

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(CLIP)


@pytest.fixture(scope="module")
def items(pipeline):
    got = list(sample_items(pipeline, 70, seed=2))
    got[5] = ("corrupt", {"image": b"\xff\xd8 truncated", "text": "a photo"})
    got[40] = ("empty", {"image": got[40][1]["image"], "text": ""})
    return got


def run(ex, items):
    """Every batch of a run, copied out: (index, names, ok, failures, outputs on the host)."""
    out = []
    with ex:
        for b in ex.stream(items):
            host = {
                k: v.copy() if isinstance(v, np.ndarray) else [None if x is None else x for x in v]
                for k, v in b.outputs.items()
            }
            out.append(
                (b.index, b.names, b.ok.copy(), [(f.index, f.reason) for f in b.failures], host)
            )
    return out


def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[:2] == w[:2]
        np.testing.assert_array_equal(g[2], w[2])
        assert g[3] == w[3]
        assert set(g[4]) == set(w[4])
        for k, wv in w[4].items():
            gv = g[4][k]
            if isinstance(wv, np.ndarray):
                assert gv.dtype == wv.dtype
                np.testing.assert_array_equal(gv, wv, err_msg=k)
            else:
                for a, b in zip(gv, wv, strict=True):
                    assert (a is None) == (b is None)
                    if a is not None:
                        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def want(pipeline, items):
    return run(Executor(pipeline, single_device_plan(pipeline), workers=2), items)


PLACEMENTS = {
    "gpu -> cpu": {"decode": "gpu0", "resize": "cpu", "crop": "cpu", "norm": "cpu", "tok": "cpu"},
    "cpu -> gpu -> cpu": {
        "decode": "cpu",
        "resize": "gpu0",
        "crop": "gpu0",
        "norm": "cpu",
        "tok": "cpu",
    },
    "gpu -> cpu -> gpu": {
        "decode": "gpu0",
        "resize": "cpu",
        "crop": "cpu",
        "norm": "gpu0",
        "tok": "cpu",
    },
    "gpu -> cpu -> gpu -> cpu": {  # topological order: decode, tok, resize, crop, norm
        "decode": "gpu0",
        "tok": "cpu",
        "resize": "gpu0",
        "crop": "gpu0",
        "norm": "cpu",
    },
}


@pytest.mark.parametrize("what", list(PLACEMENTS))
def test_a_gpu_stage_anywhere_gives_the_all_host_run(pipeline, items, want, what) -> None:
    plan = plan_of(pipeline, PLACEMENTS[what])
    assert " -> ".join(s.kind for s in plan.stages) == what
    assert not fast_path(plan)
    stand_ins = {s.name: CpuBatchStage(pipeline, s) for s in plan.stages if s.kind == "gpu"}
    ex = executor_for(pipeline, plan, workers=2, gpu_stages=stand_ins)
    assert isinstance(ex, Chain)
    assert_same(run(ex, items), want)
    assert all(s.closed and s.batches == 3 for s in stand_ins.values())


def test_the_fast_path_keeps_its_shapes(pipeline) -> None:
    for placement in (
        dict.fromkeys(PLACEMENTS["gpu -> cpu"], "cpu"),
        {**dict.fromkeys(PLACEMENTS["gpu -> cpu"], "cpu"), "norm": "gpu0"},
    ):
        plan = plan_of(pipeline, placement)
        assert fast_path(plan)


def test_the_general_path_on_one_host_stage_gives_the_fast_paths_run(pipeline, items, want) -> None:
    assert_same(run(Chain(pipeline, single_device_plan(pipeline), workers=2), items), want)


def test_a_gpu_stage_that_fails_rows_fails_those_rows_alone(pipeline, items, want) -> None:
    plan = plan_of(pipeline, PLACEMENTS["cpu -> gpu -> cpu"])
    gpu = next(s for s in plan.stages if s.kind == "gpu")

    class Refusing(CpuBatchStage):
        def stream(self, batches):
            for done in super().stream(batches):
                if self.batches == 1:
                    done.failures[3] = ItemError("gpu_says_no", "row 3")
                yield done

    got = run(
        Chain(pipeline, plan, workers=2, gpu_stages={gpu.name: Refusing(pipeline, gpu)}), items
    )
    assert (3, "gpu_says_no") in got[0][3]
    assert not got[0][2][3] and not got[0][4]["pixels"][3].any()
    assert got[0][2].sum() == want[0][2].sum() - 1
    assert_same(got[1:], want[1:])


def test_a_row_a_gpu_stage_did_not_produce_fails_as_unwritten(pipeline, items) -> None:
    plan = plan_of(pipeline, PLACEMENTS["gpu -> cpu"])
    gpu = plan.stages[0]

    class Skipping(CpuBatchStage):
        def stream(self, batches):
            for done in super().stream(batches):
                done.produced[0] = False
                yield done

    got = run(
        Chain(pipeline, plan, workers=2, gpu_stages={gpu.name: Skipping(pipeline, gpu)}), items
    )
    for index, _, ok, failures, _ in got:
        assert not ok[0] and (index * 32, "unwritten") in failures  # batches of 32


def test_a_stage_that_crashes_fails_the_run_with_its_exception(pipeline, items) -> None:
    plan = plan_of(pipeline, PLACEMENTS["gpu -> cpu"])
    gpu = plan.stages[0]

    class Crashing(CpuBatchStage):
        def stream(self, batches):
            yield from ()
            raise RuntimeError("the device fell off the bus")

    chain = Chain(pipeline, plan, workers=2, gpu_stages={gpu.name: Crashing(pipeline, gpu)})
    with chain, pytest.raises(SystemFailure, match="fell off the bus"):
        list(chain.stream(items))


def test_an_abandoned_call_leaves_the_chain_ready_for_the_next(pipeline, items, want) -> None:
    plan = plan_of(pipeline, PLACEMENTS["gpu -> cpu -> gpu"])
    stand_ins = {s.name: CpuBatchStage(pipeline, s) for s in plan.stages if s.kind == "gpu"}
    chain = Chain(pipeline, plan, workers=2, gpu_stages=stand_ins)
    first = chain.stream(items)
    next(first)
    first.close()
    assert_same(run(chain, items), want)


def test_no_items_give_no_batches_and_the_items_error_comes_back_as_it_is(pipeline, items) -> None:
    plan = plan_of(pipeline, PLACEMENTS["gpu -> cpu"])
    stand_ins = {plan.stages[0].name: CpuBatchStage(pipeline, plan.stages[0])}

    def broken():
        yield from items[:3]
        raise KeyError("the caller's own")

    with Chain(pipeline, plan, workers=2, gpu_stages=stand_ins) as chain:
        assert list(chain.stream([])) == []
        with pytest.raises(KeyError, match="the caller's own"):
            list(chain.stream(broken()))
