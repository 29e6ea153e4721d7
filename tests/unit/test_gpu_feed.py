"""The executor's GPU end without a GPU: a stand-in GpuStage (numpy, same interface) checks
the plumbing: pinned rows written in place by the host workers, order, partial batches, and
per-item failures from the host and from the GPU stage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fake_gpu import FakeGpuStage

import nicoffload
from nicoffload.graph import load_pipeline
from nicoffload.inputs import sample_items
from nicoffload.planner import plan_for
from nicoffload.runtime.executor import Executor
from nicoffload.topology import local_topology


def pinned_pipeline(tmp_path: Path, gpu_nodes: tuple[str, ...]) -> Path:
    """resnet50's recipe with the nodes in `gpu_nodes` pinned to the GPU, the rest to the CPU."""
    text = Path("pipelines/resnet50.yaml").read_text().replace("max_size: 64", "max_size: 8")
    pins = {n: "gpu" if n in gpu_nodes else "cpu" for n in ("decode", "resize", "crop", "norm")}
    text += "placement: {" + ", ".join(f"{n}: [{d}]" for n, d in pins.items()) + "}\n"
    path = tmp_path / "pinned.yaml"
    path.write_text(text)
    return path


def run_with_fake(path: Path, items, fail=frozenset()) -> tuple[list, FakeGpuStage]:
    pipeline = load_pipeline(path)
    plan = plan_for(pipeline, local_topology(emulate_dpu=False, gpu=True))
    assert [s.kind for s in plan.stages] == ["cpu", "gpu"]
    fake = FakeGpuStage(pipeline, plan.stages[-1], fail)
    with Executor(pipeline, plan, workers=3, gpu_stage=fake) as ex:
        batches = [
            (b.start, b.names, b.ok.copy(), b.failures, b.outputs["pixels"].copy())
            for b in ex.stream(items)
        ]
    assert fake.closed
    return batches, fake


def test_host_workers_write_the_gpu_stage_rows_in_place_and_outputs_match_the_host(tmp_path):
    items = sample_items(load_pipeline("pipelines/resnet50.yaml"), 21, seed=3)
    batches, fake = run_with_fake(pinned_pipeline(tmp_path, ("norm",)), items)
    want = nicoffload.run("pipelines/resnet50.yaml", items, topology=None, workers=2)
    got = np.concatenate([b[4] for b in batches])
    assert [n for b in batches for n in b[1]] == want.names
    assert fake.pinned_batches == len(batches) >= 3  # 21 items in batches of 8: one is partial
    np.testing.assert_array_equal(got[want.ok], want.outputs["pixels"][want.ok])


def test_host_and_gpu_failures_are_both_reported_by_item(tmp_path):
    items = sample_items(load_pipeline("pipelines/resnet50.yaml"), 10, seed=1)
    items[2] = ("corrupt", {"image": b"\xff\xd8 not a jpeg"})
    batches, _ = run_with_fake(pinned_pipeline(tmp_path, ("norm",)), items, frozenset({2, 9}))
    failures = [f for b in batches for f in b[3]]
    ok = np.concatenate([b[2] for b in batches])
    assert [(f.index, f.reason) for f in failures] == [
        (2, "unsupported_format"),
        (9, "gpu_says_no"),
    ]
    assert ok.tolist() == [i not in (2, 9) for i in range(10)]
    pixels = np.concatenate([b[4] for b in batches])
    assert not pixels[2].any() and not pixels[9].any()  # a failed row is zero


def test_the_planner_places_nothing_on_a_gpu_the_topology_lacks():
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    plan = plan_for(pipeline, local_topology(gpu=False))
    assert "gpu" not in {s.kind for s in plan.stages}


def test_importing_the_registry_imports_no_gpu_library():
    import subprocess
    import sys

    code = (
        "import sys, nicoffload; from nicoffload import ops; ops.all_kernels(); "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_runs_plan_for_the_autodetected_gpu_with_its_profile(monkeypatch):
    from nicoffload import runner, topology

    monkeypatch.setattr(topology, "_cuda_gpu_name", lambda: "NVIDIA H200")
    prep = runner.prepare("pipelines/resnet50.yaml")
    assert prep.topology.device("gpu0").profile.endswith("h200.json")
    assert prep.plan.stages[-1].kind == "gpu"
