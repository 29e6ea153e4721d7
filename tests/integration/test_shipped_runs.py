"""The shipped pipelines as a new user runs them: `nicoffload run PIPELINE --sample N` with the
default plan on this machine (the host plus an emulated DPU: a local agent process), and with
`run --plan` of the host-cpu objective's plan, which puts every node on the DPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from nicoffload.cli import build_app


def cli(*args):
    return CliRunner().invoke(build_app(), [*map(str, args)])


def test_the_shipped_clip_pipeline_runs_with_its_default_plan(tmp_path):
    result = cli("run", "pipelines/clip.yaml", "--sample", 20, "--json", "--output", tmp_path / "o")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["errors"] == 0 and doc["items"] == 20
    ids = np.load(tmp_path / "o" / "input_ids.npy")
    assert (ids[:, 0] != 0).all()  # every text got its tokens, not a zero row


@pytest.mark.parametrize("name", ["resnet50", "bert", "clip"])
def test_a_host_cpu_plan_run_with_run_plan_returns_real_outputs(name, tmp_path):
    plan = tmp_path / "plan.json"
    made = cli("plan", f"pipelines/{name}.yaml", "--objective", "host-cpu", "--output", plan)
    assert made.exit_code == 0, made.output
    out = tmp_path / "o"
    result = cli("run", f"pipelines/{name}.yaml", "--sample", 12, "--plan", plan, "--output", out)
    assert result.exit_code == 0, result.output
    host = cli("run", f"pipelines/{name}.yaml", "--sample", 12, "--output", tmp_path / "h")
    assert host.exit_code == 0, host.output
    for f in sorted(out.glob("*.npy")):
        got, want = np.load(f), np.load(tmp_path / "h" / f.name)
        assert got.any(), f"{f.name} is all zeros"
        np.testing.assert_array_equal(got, want, err_msg=f.name)


def test_a_tokenizer_named_by_path_runs_on_the_emulated_dpu(tmp_path):
    """An agent takes tokenizers by id only; for the local agent it starts, the host stages
    the file the pipeline names by path (runtime/loadtext.py)."""
    import shutil

    from nicoffload.ops import DATA_DIR

    (tmp_path / "sub").mkdir()
    shutil.copyfile(DATA_DIR / "bert-base-uncased.json", tmp_path / "sub" / "my tok.json")
    texts = ["a first text", "", "another one, longer than the first"]
    for kind in ("cpu", "dpu"):
        path = tmp_path / f"{kind}.yaml"
        path.write_text(
            f"""
name: own-tokenizer
inputs: {{text: {{kind: text}}}}
nodes:
  - {{name: tok, op: tokenize, in: text, params: {{tokenizer: "sub/my tok.json", max_length: 16}}}}
outputs: {{ids: tok.input_ids}}
placement: {{tok: [{kind}]}}
"""
        )
    import nicoffload

    want = nicoffload.run(tmp_path / "cpu.yaml", texts)
    got = nicoffload.run(tmp_path / "dpu.yaml", texts)
    assert got.stats.placement == {"tok": "dpu0"} and got.stats.failover is None
    assert got.ok.all()
    np.testing.assert_array_equal(got.outputs["ids"], want.outputs["ids"])
