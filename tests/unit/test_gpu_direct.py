"""The all-GPU path (`runtime/gpu_direct.py`) without a GPU: a plan that is one GPU stage, run by
the executor through a stand-in stage (the CPU kernels, a batch at a time, the GpuStage's
interface): batches formed once at ingress, partial ones after max_wait, row status (a row the
stage did not produce never comes out as ok), failures by item, and calls after an abandoned one."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import nicoffload
from nicoffload.errors import ItemError
from nicoffload.graph import load_pipeline
from nicoffload.inputs import sample_items
from nicoffload.planner.plan import single_device_plan
from nicoffload.runtime.batch import UNWRITTEN
from nicoffload.runtime.executor import Executor
from nicoffload.runtime.stage import Stage

PIPELINE = dataclasses.replace(load_pipeline("pipelines/resnet50.yaml"), batch_max_size=8)


@dataclass
class FakeBatch:
    n: int
    outputs: dict[str, Any]
    failures: dict[int, ItemError]
    produced: np.ndarray


class CpuAsGpuStage:
    """The GPU stage's interface over the CPU kernels; leaves the items in `drop` unproduced
    (a faulty stage), and records the batches it was handed."""

    def __init__(self, plan, drop: frozenset[int] = frozenset()) -> None:
        cpu = dataclasses.replace(plan, device="cpu", kind="cpu")
        self.cpu = Stage(PIPELINE, cpu, {"norm"})
        self.steps = self.cpu.steps
        self.plan, self.drop = plan, drop
        self.inputs, self.outputs = ["image"], ["norm"]
        self.sizes: list[int] = []
        self.closed = False

    def stream(self, batches):
        start = 0
        for b in batches:
            images = b["image"]
            assert isinstance(images, list)  # the batch's bytes, handed over as one list
            n = len(images)
            self.sizes.append(n)
            out = np.zeros((n, 3, 224, 224), np.float16)
            produced, failures = np.zeros(n, bool), {}
            for i, data in enumerate(images):
                if start + i in self.drop:
                    continue
                try:
                    values = {"image": data}
                    self.cpu.process(values, {})
                    out[i] = values["norm"]
                    produced[i] = True
                except ItemError as exc:
                    failures[i] = exc
            start += n
            yield FakeBatch(n, {"norm": out}, failures, produced)

    def begin_call(self) -> None:
        pass

    def step_ms_per_item(self) -> dict[str, float]:
        return {s.name: 0.0 for s in self.steps}

    def close(self) -> None:
        self.closed = True


def executor(drop: frozenset[int] = frozenset()) -> tuple[Executor, CpuAsGpuStage]:
    plan = single_device_plan(PIPELINE, "gpu0")
    fake = CpuAsGpuStage(plan.stages[0], drop)
    ex = Executor(PIPELINE, plan, workers=2, gpu_stage=fake)
    assert ex.direct is not None
    return ex, fake


@pytest.fixture(scope="module")
def items():
    got = sample_items(PIPELINE, 19, seed=4)
    got[5] = ("corrupt", {"image": b"\xff\xd8\xff\xe0 truncated"})
    return got


@pytest.fixture(scope="module")
def host(items):
    return nicoffload.run(PIPELINE, items, plan=single_device_plan(PIPELINE, "cpu"))


def test_a_one_gpu_stage_plan_gets_whole_batches_and_matches_the_host(items, host):
    ex, fake = executor()
    with ex:
        batches = list(ex.stream(items))
    assert fake.sizes == [8, 8, 3]
    assert [n for b in batches for n in b.names] == host.names
    ok = np.concatenate([b.ok for b in batches])
    assert ok.tolist() == host.ok.tolist() and not ok[5]
    got = np.concatenate([b.outputs["pixels"] for b in batches])
    np.testing.assert_array_equal(got[ok], host.outputs["pixels"][ok])
    assert not got[5].any()  # a failed row is zero
    assert [(f.index, f.reason) for b in batches for f in b.failures] == [
        (f.index, f.reason) for f in host.failures
    ]


def test_a_row_the_stage_did_not_produce_fails_as_unwritten(items):
    ex, _ = executor(drop=frozenset({3, 12}))
    with ex:
        batches = list(ex.stream(items))
    failures = {f.index: f.reason for b in batches for f in b.failures}
    assert failures[3] == failures[12] == UNWRITTEN
    ok = np.concatenate([b.ok for b in batches])
    assert not ok[3] and not ok[12] and ok.sum() == 19 - 3


def test_a_partial_batch_ships_after_max_wait_while_the_items_iterator_blocks(items):
    ex, _ = executor()
    release = threading.Event()

    def slow():
        yield from items[:3]
        release.wait(10)
        yield from items[3:5]

    with ex:
        stream = ex.stream(slow())
        t0 = time.perf_counter()
        first = next(stream)
        waited = time.perf_counter() - t0
        release.set()
        rest = list(stream)
    assert first.names == [n for n, _ in items[:3]] and waited < 5
    assert [n for b in rest for n in b.names] == [n for n, _ in items[3:5]]


def test_a_call_after_an_abandoned_one_gets_its_own_items(items, host):
    ex, _ = executor()
    with ex:
        stream = ex.stream(items)
        next(stream)
        stream.close()
        again = list(ex.stream(items[8:]))
    assert [n for b in again for n in b.names] == host.names[8:]
    assert np.concatenate([b.ok for b in again]).all()


def test_an_items_iterator_that_raises_is_reraised_to_the_caller(items):
    ex, _ = executor()

    def broken():
        yield from items[:4]
        raise ValueError("bad source")

    with ex, pytest.raises(ValueError, match="bad source"):
        list(ex.stream(broken()))
