"""The Batcher on a real host-only Session (in process, no agent): requests through one stream,
matched back by item name, the model's failures kept to their batch."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import nicoffload
from nicoffload.runner import prepare
from nicoffload.samples import sample_images
from nicoffload.serve.batcher import Batcher, Outcome, Pending
from nicoffload.session import Session
from nicoffload.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = "name: cpu-only\ningress: cpu\ndevices:\n  cpu: {kind: cpu, cores: 2}\nlinks: []\n"


@pytest.fixture(scope="module")
def prep(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batcher")
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text()
    # batches of 2: a request of 5 items spans 3 of them
    (folder / "p.yaml").write_text(text.replace("batch: {max_size: 64", "batch: {max_size: 2"))
    (folder / "cpu.yaml").write_text(CPU_ONLY)
    return prepare(folder / "p.yaml", None, load_topology(folder / "cpu.yaml"))


@pytest.fixture(scope="module")
def images():
    return [b for _, b in sample_images(5, 7)]


def ask(batcher: Batcher, items: list[dict]) -> Outcome:
    got: list[Outcome] = []
    done = threading.Event()
    now = time.perf_counter()
    batcher.submit(Pending(items, lambda o: (got.append(o), done.set()), now, now))
    assert done.wait(120)
    return got[0]


def serving(prep, model=None):
    session = Session(prep)
    batcher = Batcher(session, model, max_queue=64)
    batcher.start()
    return session, batcher


def test_a_request_over_several_batches_comes_back_whole_and_in_order(prep, images):
    want = nicoffload.run(prep.pipeline, images, plan=prep.plan).outputs["pixels"]
    session, batcher = serving(prep)
    with session:
        out = ask(batcher, [{"image": b} for b in images])
        batcher.stop(30)
    assert out.status == 200 and out.timings["batches"] == 3
    assert out.outputs["pixels"].tobytes() == want.tobytes()


def test_a_model_that_raises_fails_its_batch_only(prep, images):
    calls = []

    def model(outs):
        calls.append(len(outs["pixels"]))
        if len(calls) == 1:
            raise RuntimeError("cuda out of memory")
        return {"n": np.arange(len(outs["pixels"]))}

    session, batcher = serving(prep, model)
    with session:
        first = ask(batcher, [{"image": images[0]}])
        second = ask(batcher, [{"image": images[1]}])
        batcher.stop(30)
    assert first.status == 500 and "RuntimeError: cuda out of memory" in first.error
    assert second.status == 200 and second.outputs["n"].tolist() == [0]
    assert "model_us" in second.timings


def test_a_model_with_the_wrong_number_of_rows_is_a_500(prep, images):
    session, batcher = serving(prep, lambda outs: {"x": np.zeros(7)})
    with session:
        out = ask(batcher, [{"image": images[0]}])
        batcher.stop(30)
    assert out.status == 500 and "not 1 rows" in out.error


def test_a_corrupt_item_fails_its_request_with_the_reason(prep, images):
    session, batcher = serving(prep)
    with session:
        out = ask(batcher, [{"image": images[0]}, {"image": b"\xff\xd8\xff" + b"\0" * 50}])
        batcher.stop(30)
    assert out.status == 400 and out.error.startswith("item 1: ")
    assert batcher.outstanding == 0


def test_a_requests_parts_follow_its_item_through_the_executor_and_sum_to_server_us(prep, images):
    session, batcher = serving(prep)
    with session:
        t = ask(batcher, [{"image": images[0]}]).timings
        batcher.stop(30)
    parts = ["receive_us", "queue_us", "admit_us", "host_us", "batch_us", "order_us", "answer_us"]
    assert [k for k in t if k.endswith("_us")] == [*parts, "server_us"]
    # no agent in this plan: nothing waited to be sent to one, nothing came back from it
    assert "dpu_us" not in t and "batch_wait_us" not in t and "pipeline_us" not in t
    # consecutive intervals, each rounded to a microsecond on its own
    assert abs(sum(t[k] for k in parts) - t["server_us"]) <= len(parts)
    assert t["host_us"] > 0


def test_closing_batches_when_idle_answers_a_lone_item_before_the_max_wait(tmp_path, images):
    # a max wait of ten minutes: held open for it, the lone item's batch would outlast ask()
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text()
    text = text.replace("max_wait_ms: 2}", "max_wait_ms: 600000}")
    (tmp_path / "p.yaml").write_text(text)
    (tmp_path / "cpu.yaml").write_text(CPU_ONLY)
    session, batcher = serving(
        prepare(tmp_path / "p.yaml", None, load_topology(tmp_path / "cpu.yaml"))
    )
    with session:
        session.executor.close_when_idle = True
        out = ask(batcher, [{"image": images[0]}])
        batcher.stop(30)
    assert out.status == 200 and out.timings["batches"] == 1


class _Tensor:
    """A torch-like output: on the GPU, `cpu().numpy()` is a fresh copy; on the host it is the
    tensor's own (reused) buffer, as torch's is."""

    def __init__(self, buf: np.ndarray, is_cuda: bool) -> None:
        self.buf, self.is_cuda = buf, is_cuda

    def cpu(self) -> _Tensor:
        return _Tensor(self.buf.copy() if self.is_cuda else self.buf, False)

    def numpy(self) -> np.ndarray:
        return self.buf


class _ReusedBuffer:
    """A session whose every batch (one item) writes its item's number into ONE buffer."""

    executor = None

    def __init__(self, is_cuda: bool) -> None:
        self.buf, self.is_cuda = np.zeros((1, 4), np.int64), is_cuda

    def stream(self, items):
        from nicoffload.runtime.batch import Batch

        for i, (name, _) in enumerate(items):
            self.buf[:] = i
            yield Batch(i, i, [name], {"x": _Tensor(self.buf, self.is_cuda)},
                        np.ones(1, bool), [], np.zeros(1))  # fmt: skip


@pytest.mark.parametrize("is_cuda", [True, False])
def test_answers_hold_their_own_rows_when_the_next_batch_reuses_the_buffer(is_cuda):
    got: list[Outcome] = []
    batcher = Batcher(_ReusedBuffer(is_cuda), None, max_queue=8)
    batcher.start()
    now = time.perf_counter()
    for _ in range(3):
        batcher.submit(Pending([{"image": b""}], got.append, now, now))
    batcher.stop(30)
    # a host tensor's buffer is copied out; a GPU one's fresh copy is used as it is
    assert [o.outputs["x"][0, 0] for o in got] == [0, 1, 2]
