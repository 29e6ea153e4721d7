"""`nicoffload run`: the JSON document, the output files, and mistakes in its arguments."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import simplejpeg
from typer.testing import CliRunner

from nicoffload.cli import build_app

# Small pipelines pinned to the host CPU: no DPU agent starts, and a run takes a fraction of a second.
TEXT_PIPELINE = """\
name: tiny-text
inputs: {text: {kind: text}}
nodes:
  - {name: tok, op: tokenize, in: text, params: {max_length: 8}}
outputs: {ids: tok.input_ids}
placement: {tok: cpu}
"""
IMAGE_PIPELINE = """\
name: tiny-image
inputs: {image: {kind: bytes, format: jpeg, typical: {height: 16, width: 16, bytes: 800}}}
nodes:
  - {name: decode, op: decode_image, in: image}
  - {name: resize, op: resize, in: decode, params: {size: [8, 8]}}
outputs: {pixels: resize}
placement: {decode: cpu, resize: cpu}
batch: {max_size: 2, max_wait_ms: 1}
"""


def pipeline_file(tmp_path, text=IMAGE_PIPELINE):
    path = tmp_path / ("image.yaml" if text is IMAGE_PIPELINE else "text.yaml")
    path.write_text(text)
    return path


def images(tmp_path, good=2, junk=0, truncated=0, name="images"):
    """A folder of 16x16 JPEGs, files that are no image (unsupported_format) and JPEGs cut short
    (truncated)."""
    folder = tmp_path / name
    folder.mkdir()
    for i in range(good + truncated):
        pixels = np.full((16, 16, 3), 40 * i % 256, np.uint8)
        data = simplejpeg.encode_jpeg(pixels, 90)
        (folder / f"g{i:02d}.jpg").write_bytes(data if i < good else data[: len(data) // 3])
    for i in range(junk):
        (folder / f"j{i:02d}.jpg").write_bytes(b"not an image at all")
    return folder


def texts(tmp_path, n=5):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(n):
        (folder / f"t{i:02d}.txt").write_text(f"sentence number {i} for the test")
    (folder / "README.md").write_text("not an input: only .txt files feed a text pipeline")
    return folder


def invoke(*args):
    return CliRunner().invoke(build_app(), ["run", *map(str, args)])


def test_run_json_prints_one_document_with_the_designed_fields(tmp_path):
    result = invoke("pipelines/bert.yaml", "--input", texts(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["items"] == 5 and doc["errors"] == 0
    assert set(doc["latency_ms"]) == {"p50", "p99"}
    assert doc["placement"] == {"tok": "cpu"}
    assert all({"device", "ms_per_item"} <= set(s) for s in doc["stages"].values())
    assert "host_cpu_ms_per_item" in doc and "throughput_per_s" in doc


def test_run_output_writes_numpy_files_in_item_order(tmp_path):
    out = tmp_path / "out"
    result = invoke("pipelines/bert.yaml", "--input", texts(tmp_path), "--output", out, "--json")
    assert result.exit_code == 0, result.output
    ids = np.load(out / "input_ids.npy")
    assert ids.shape == (5, 128) and ids.dtype == np.int64
    items = json.loads((out / "items.json").read_text())
    assert [i["name"] for i in items] == [f"t{i:02d}.txt" for i in range(5)]
    assert all(i["ok"] for i in items)
    assert json.loads((out / "summary.json").read_text())["items"] == 5


def test_run_without_inputs_is_a_usage_error():
    result = invoke("pipelines/bert.yaml")
    assert result.exit_code == 2
    assert "give exactly one of --input DIR or --sample N" in result.output


def test_run_on_a_missing_folder_is_a_user_error(tmp_path):
    result = invoke("pipelines/bert.yaml", "--input", tmp_path / "nowhere")
    assert result.exit_code == 2
    assert "is not a folder" in result.output


def test_run_with_a_plan_for_another_pipeline_is_refused(tmp_path):
    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import single_device_plan

    plan = tmp_path / "plan.json"
    single_device_plan(load_pipeline("pipelines/resnet50.yaml")).save(plan)
    result = invoke("pipelines/bert.yaml", "--input", texts(tmp_path), "--plan", plan)
    assert result.exit_code == 2
    assert "plan it again" in result.output


def test_the_summary_shows_the_transfer_against_its_plan_and_where_it_landed_on_the_gpu():
    from rich.console import Console

    from nicoffload.cli.run import summary_table
    from nicoffload.runner import RunStats

    stats = RunStats(items=64, wall_s=1.0, latencies_s=[0.1] * 64)
    stats.transfers["s0-dpu0->s1-gpu0"] = {
        "tensor": "crop",
        "transport": "tcp+pcie",
        "batches": 2,
        "bytes_per_item": 301056,
        "predicted_bytes_per_item": 150528,
        "ms_per_batch": 3.2,
        "gpu_landing": {"destination": "pinned-host", "reason": "why", "batches": 2, "bytes": 1},
    }
    console = Console(width=200, record=True)
    console.print(summary_table(stats))
    text = console.export_text()
    assert "crop over tcp+pcie: 301 KB/item (planned for 151), 2 batches, 3.20 ms/batch" in text
    assert "into the GPU" in text and "pinned-host: 2 batches (why)" in text


def test_a_missing_token_file_is_a_user_error_naming_the_path(tmp_path):
    token = tmp_path / "nowhere.token"
    result = invoke(pipeline_file(tmp_path, TEXT_PIPELINE), "--sample", 1, "--token-file", token)
    assert result.exit_code == 2, result.output
    assert f"{token}:1:1: --token-file: cannot read the token file: No such file" in result.stderr
    assert "Traceback" not in result.output


def dpu_plan(tmp_path, pipeline):
    """A plan made for a topology with a DPU: the tokenizer on dpu0."""
    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import single_device_plan

    plan = single_device_plan(load_pipeline(pipeline), "dpu0")
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, topology="bluefield3-h100").save(path)
    return path


def test_a_plan_for_a_device_the_topology_lacks_is_refused_naming_the_device(tmp_path):
    pipeline = pipeline_file(tmp_path, TEXT_PIPELINE)
    plan = dpu_plan(tmp_path, pipeline)
    topology = "pipelines/topologies/host-only.yaml"
    result = invoke(pipeline, "--sample", 1, "--plan", plan, "--topology", topology)
    assert result.exit_code == 2, result.output
    assert (
        f"{plan}:1:1: the plan places stage 's0-dpu0' (tok) on device 'dpu0', which topology "
        f"'host-only' ({topology}) lacks (it has cpu, gpu0)"
    ) in result.stderr
    assert "Traceback" not in result.output


def test_a_plan_with_a_dpu_stage_and_no_topology_is_refused_with_exit_2(tmp_path):
    pipeline = pipeline_file(tmp_path, TEXT_PIPELINE)
    plan = dpu_plan(tmp_path, pipeline)
    result = invoke(pipeline, "--sample", 1, "--plan", plan)
    assert result.exit_code == 2, result.output
    assert "on device 'dpu0' of topology 'bluefield3-h100'; give that topology" in result.stderr


def test_a_run_in_which_every_item_fails_exits_1_with_the_reasons_counted(tmp_path):
    folder = images(tmp_path, good=0, junk=2, truncated=1)
    result = invoke(pipeline_file(tmp_path), "--input", folder)
    assert result.exit_code == 1, result.output
    assert "nicoffload: failure: run: every item failed (3 of 3): " in result.stderr
    assert "truncated: 1 (first: g00.jpg: " in result.stderr
    assert "unsupported_format: 2 (first: j00.jpg: no known image signature" in result.stderr
    assert "Traceback" not in result.output


def test_a_run_in_which_some_items_fail_exits_0(tmp_path):
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, good=2, junk=1))
    assert result.exit_code == 0, result.output


def test_strict_makes_any_failed_item_fatal(tmp_path):
    folder = images(tmp_path, good=2, junk=1)
    result = invoke(pipeline_file(tmp_path), "--input", folder, "--strict")
    assert result.exit_code == 1, result.output
    assert (
        "run: 1 of 3 items failed, and --strict makes any failure fatal: unsupported_format: 1 "
        "(first: j00.jpg: "
    ) in result.stderr


def test_strict_passes_a_run_without_failures(tmp_path):
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, good=2), "--strict")
    assert result.exit_code == 0, result.output


def test_a_run_that_fails_through_its_items_still_prints_one_json_document(tmp_path):
    folder = images(tmp_path, good=1, junk=1)
    for extra in ([], ["--strict"]):
        args = ["--input", folder, "--json", *extra]
        result = invoke(pipeline_file(tmp_path), *args)
        assert result.exit_code == (1 if extra else 0), result.output
        doc = json.loads(result.stdout)  # the whole of stdout: one document, nothing else
        assert doc["items"] == 2 and doc["errors_by_reason"] == {"unsupported_format": 1}
    result = invoke(
        pipeline_file(tmp_path), "--input", images(tmp_path, 0, 2, name="bad"), "--json"
    )
    assert result.exit_code == 1
    assert json.loads(result.stdout)["errors"] == 2


def test_a_refused_run_prints_nothing_on_stdout_with_json(tmp_path):
    pipeline = pipeline_file(tmp_path, TEXT_PIPELINE)
    result = invoke(pipeline, "--sample", 1, "--plan", dpu_plan(tmp_path, pipeline), "--json")
    assert result.exit_code == 2
    assert result.stdout == ""


def test_a_text_the_tokenizer_cannot_encode_is_that_items_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # No [UNK], but it holds the words the load-time check tries: only the run finds the gap.
    vocab = {"[PAD]": 0, "nicoffload": 1, "\U000f0000\U000f0001": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok.json"))
    pipeline = pipeline_file(
        tmp_path, TEXT_PIPELINE.replace("max_length: 8", "tokenizer: tok.json")
    )
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("nicoffload")
    (folder / "b.txt").write_text("hello")
    result = invoke(pipeline, "--input", folder, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["errors_by_reason"] == {"tokenize_failed": 1}
    assert doc["error_examples"]["tokenize_failed"].startswith("b.txt: WordLevel error: Missing")


def test_the_summary_puts_the_plans_prediction_beside_each_measured_figure():
    from rich.console import Console

    from nicoffload.cli.run import summary_table
    from nicoffload.runner import RunStats

    stats = RunStats(items=100, wall_s=0.5, latencies_s=[0.01] * 100, host_cpu_s=0.2)
    stats.predicted = {"throughput_per_s": 250.0, "latency_ms": 3.5, "host_cpu_ms_per_item": 1.0}
    console = Console(width=200, record=True)
    console.print(summary_table(stats))
    text = console.export_text()
    assert "200.0 items/s   (predicted 250.0 items/s, +25%)" in text
    assert "2.000 ms/item   (predicted 1.000, -50%)" in text
    assert "(predicted 3.50 ms for an item alone" in text
    assert stats.to_json()["predicted"] == stats.predicted
    stats.predicted = None  # a plan with no prediction: the measured figures alone
    console = Console(width=200, record=True)
    console.print(summary_table(stats))
    assert "predicted" not in console.export_text()


def test_host_assist_with_a_plan_file_is_refused_naming_where_it_belongs(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    result = invoke("pipelines/bert.yaml", "--sample", 4, "--plan", plan, "--host-assist")
    assert result.exit_code == 2
    assert "plan --host-assist" in result.output
