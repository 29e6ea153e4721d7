"""The host runtime: order, batching, exact tokenizer outputs, per-item errors, worker crashes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import nicoffload
from nicoffload.errors import SystemFailure
from nicoffload.ops import DATA_DIR

TEXTS = [
    "Hello world.",
    "",
    "DPUs move preprocessing off the host CPU, leaving its cores to the model server. " * 30,
    "Ünïcödé, emoji 🚀 and CJK 漢字 are tokenized too.",
    "A",
    "two words",
]


def pipeline_file(
    tmp_path: Path, max_size: int = 4, max_wait_ms: float = 2, max_length: int = 32
) -> Path:
    path = tmp_path / "text.yaml"
    path.write_text(
        f"""
name: text
inputs: {{text: {{kind: text}}}}
nodes:
  - {{name: tok, op: tokenize, in: text, params: {{max_length: {max_length}}}}}
outputs: {{ids: tok.input_ids, mask: tok.attention_mask}}
batch: {{max_size: {max_size}, max_wait_ms: {max_wait_ms}}}
"""
    )
    return path


def test_tokenize_equals_the_tokenizers_library_exactly():
    texts = TEXTS * 20
    result = nicoffload.run("pipelines/bert.yaml", texts, workers=2)
    ref = Tokenizer.from_file(str(DATA_DIR / "bert-base-uncased.json"))
    ref.enable_truncation(max_length=128)
    ref.enable_padding(length=128)
    want = ref.encode_batch(texts)
    assert result.ok.all()
    np.testing.assert_array_equal(result.outputs["input_ids"], np.array([e.ids for e in want]))
    np.testing.assert_array_equal(
        result.outputs["attention_mask"], np.array([e.attention_mask for e in want])
    )


def test_items_come_back_in_order_across_batches_and_workers(tmp_path):
    texts = [f"item number {i}" for i in range(103)]
    # a wait far longer than the run: batches close only when full, however loaded the machine
    path = pipeline_file(tmp_path, max_size=4, max_wait_ms=60_000)
    result = nicoffload.run(path, texts, workers=2)
    single = nicoffload.run(path, texts, workers=1)
    assert result.names == [str(i) for i in range(103)]
    assert result.stats.batches == 26
    np.testing.assert_array_equal(result.outputs["ids"], single.outputs["ids"])


def test_a_failing_item_is_counted_and_the_others_are_unaffected(tmp_path):
    items = ["good one", b"\xff\xfe not utf-8", "good two"]
    result = nicoffload.run(pipeline_file(tmp_path), items)
    assert result.ok.tolist() == [True, False, True]
    assert [(f.index, f.reason) for f in result.failures] == [(1, "bad_text")]
    assert result.stats.errors_by_reason == {"bad_text": 1}
    assert "not UTF-8" in result.stats.error_examples["bad_text"]  # `run` prints it
    assert not result.outputs["ids"][1].any()
    clean = nicoffload.run(pipeline_file(tmp_path), ["good one", "good two"])
    np.testing.assert_array_equal(result.outputs["ids"][[0, 2]], clean.outputs["ids"])


def test_a_crashing_kernel_fails_the_run_with_the_original_error_as_cause(tmp_path):
    with pytest.raises(SystemFailure) as info:
        nicoffload.run(pipeline_file(tmp_path), ["fine", 12345, "fine"])
    assert isinstance(info.value.__cause__, TypeError)


def test_a_slow_source_gets_partial_batches_after_max_wait(tmp_path):
    def slow():
        for i in range(6):
            if i == 3:
                time.sleep(0.3)  # far longer than max_wait_ms
            yield f"text {i}"

    result = nicoffload.run(pipeline_file(tmp_path, max_size=64, max_wait_ms=5), slow())
    assert result.stats.items == 6
    assert result.stats.batches >= 2


def test_stats_report_every_field_of_run_json(tmp_path):
    doc = nicoffload.run(pipeline_file(tmp_path), TEXTS).stats.to_json()
    assert {
        "items",
        "errors",
        "throughput_per_s",
        "latency_ms",
        "placement",
        "stages",
        "host_cpu_ms_per_item",
    } <= set(doc)
    assert doc["items"] == len(TEXTS) and doc["errors"] == 0
    (stage,) = doc["stages"].values()
    assert stage["device"] == "cpu" and stage["ms_per_item"] > 0
    assert doc["latency_ms"]["p99"] >= doc["latency_ms"]["p50"] > 0


def test_outputs_reach_torch_through_dlpack_without_a_copy(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (extra 'gpu')")
    result = nicoffload.run(pipeline_file(tmp_path), TEXTS)
    tensors = result.torch()
    assert tensors["ids"].data_ptr() == result.outputs["ids"].ctypes.data
    assert torch.equal(tensors["ids"], torch.from_numpy(result.outputs["ids"]))


def _tokenize_stage(tmp_path):
    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import StagePlan
    from nicoffload.runtime.stage import Stage

    pipeline = load_pipeline(pipeline_file(tmp_path))
    return Stage(pipeline, StagePlan("s0-cpu", "cpu", "cpu", ("tok",)), {"tok.input_ids"})


def test_a_stage_counts_cpu_time_in_its_kernels_not_time_spent_waiting(tmp_path):
    from dataclasses import replace

    stage = _tokenize_stage(tmp_path)
    (step,) = stage.steps

    def waits(text, out=None):
        time.sleep(0.05)  # descheduled: wall time passes, the thread's CPU clock does not
        return step.fn(text, out=out)

    stage.steps = [replace(step, fn=waits)]
    for text in ("one", "two"):
        stage.process({"text": text}, {})
    (t,) = stage.times().values()
    assert t.calls == 2
    assert t.wall_ms >= 50 > t.cpu_ms > 0


def test_a_run_reports_each_step_and_the_wall_time_beside_the_cpu_time(tmp_path):
    doc = nicoffload.run(pipeline_file(tmp_path), TEXTS).stats.to_json()
    (stage,) = doc["stages"].values()
    assert set(stage["steps"]) == {"tok"}
    assert stage["ms_per_item"] == pytest.approx(sum(stage["steps"].values()), abs=1e-3)
    assert stage["wall_ms_per_item"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share")
def test_the_host_keeps_off_the_cores_of_an_emulated_dpu_while_it_runs():
    import threading

    from nicoffload.runtime.remote import cores_apart

    before = os.sched_getaffinity(0)
    taken = [min(before)]
    seen = []
    with cores_apart(taken) as mine:
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert os.sched_getaffinity(0) == set(mine) == before - set(taken)
    assert seen == [before - set(taken)]  # threads started inside inherit it
    assert os.sched_getaffinity(0) == before
