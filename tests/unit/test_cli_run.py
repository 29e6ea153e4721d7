"""`nicoffload run`: the JSON document, the output files, and mistakes in its arguments."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from nicoffload.cli import build_app


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
