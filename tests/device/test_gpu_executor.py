"""The executor with a trailing GPU stage, end to end on the GPU: a GPU-only plan fed bytes,
host stages writing straight into pinned rows (static crossing tensor), host stages whose
per-item images are collected (dynamic shape), and CUDA outputs handed over without a copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import nicoffload
from nicoffload.graph import load_pipeline
from nicoffload.inputs import sample_items
from nicoffload.planner import plan_for
from nicoffload.topology import local_topology

RESNET = "pipelines/resnet50.yaml"
NODES = ("decode", "resize", "crop", "norm")
# nvJPEG against libjpeg-turbo: about 2 uint8 levels on photographs, /255/0.225 after normalize
DECODE_TOL = 0.05


def pinned(tmp_path: Path, on_gpu: tuple[str, ...]) -> Path:
    text = Path(RESNET).read_text().replace("max_size: 64", "max_size: 16")
    pins = ", ".join(f"{n}: [{'gpu' if n in on_gpu else 'cpu'}]" for n in NODES)
    path = tmp_path / "pinned.yaml"
    path.write_text(text + "placement: {" + pins + "}\n")
    return path


def run_on(path: Path, items):
    pipeline = load_pipeline(path)
    plan = plan_for(pipeline, local_topology(emulate_dpu=False, gpu=True))
    return plan, nicoffload.run(pipeline, items, plan=plan, workers=4)


@pytest.fixture(scope="module")
def items():
    got = sample_items(load_pipeline(RESNET), 45, seed=5)
    got[7] = ("corrupt", {"image": b"\xff\xd8\xff\xe0 truncated"})
    return got


@pytest.mark.parametrize(
    ("on_gpu", "tol"),
    [
        (NODES, DECODE_TOL),  # GPU-only: bytes fed straight to the GPU stage
        (("norm",), 2e-3),  # crop output (static) written by the workers into pinned rows
        (("resize", "crop", "norm"), 2e-2),  # decoded images (dynamic) collected per item
    ],
    ids=["gpu-only", "pinned-rows", "collected-rows"],
)
def test_a_trailing_gpu_stage_matches_the_host(gpu, tmp_path, items, on_gpu, tol):
    (tmp_path / "host").mkdir()
    want = run_on(pinned(tmp_path / "host", ()), items)[1]
    plan, got = run_on(pinned(tmp_path, on_gpu), items)
    assert [s.kind for s in plan.stages][-1] == "gpu"
    assert got.names == want.names
    assert got.ok.tolist() == want.ok.tolist() and not got.ok[7]
    assert [f.index for f in got.failures] == [7]
    diff = np.abs(got.outputs["pixels"].astype(np.float32) - want.outputs["pixels"])
    assert diff[got.ok].mean() <= tol
    assert not got.outputs["pixels"][7].any()
    gpu_stage = next(s for s in got.stats.stages.values() if s["device"] == "gpu0")
    assert gpu_stage["ms_per_item"] > 0 and gpu_stage["predicted_ms_per_item"] is not None
    pixels = got.torch()["pixels"]
    assert pixels.is_cuda and tuple(pixels.shape) == (45, 3, 224, 224)
