"""GPU stages anywhere in a plan, on the GPU, through the general path (`runtime.chain`): a GPU
stage followed by host stages, host -> GPU -> host, two GPU stages with the host between, and a
DPU stage feeding a GPU stage that feeds the host. Row status must equal the all-host run's;
outputs match it within what the GPU kernels differ by (nvJPEG's decode most), and outputs a GPU stage made are CUDA tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from split_plans import plan_of

import nicoffload
from nicoffload.graph import load_pipeline
from nicoffload.inputs import sample_items
from nicoffload.planner.plan import single_device_plan
from nicoffload.runtime.chain import Chain, fast_path
from nicoffload.topology import local_topology

RESNET = "pipelines/resnet50.yaml"
DECODE_TOL = 0.05  # nvJPEG against libjpeg-turbo, after normalize (tests/device/test_gpu_executor)
# decoded on the host, resized and cropped on the GPU: a uint8 level here and there against the
# host's fused resize+crop+norm (0.0033 on the H200), as test_gpu_executor's collected rows
HOST_TOL = 2e-2


def place(decode, resize, crop, norm) -> dict[str, str]:
    return {"decode": decode, "resize": resize, "crop": crop, "norm": norm}


SHAPES = {
    "gpu -> cpu": (place("gpu0", "cpu", "cpu", "cpu"), DECODE_TOL),
    "cpu -> gpu -> cpu": (place("cpu", "gpu0", "gpu0", "cpu"), HOST_TOL),
    "gpu -> cpu -> gpu": (place("gpu0", "cpu", "cpu", "gpu0"), DECODE_TOL),
    "gpu -> cpu -> gpu (resize on the host)": (place("gpu0", "cpu", "gpu0", "gpu0"), DECODE_TOL),
    "dpu -> gpu -> cpu": (place("dpu0", "gpu0", "gpu0", "cpu"), HOST_TOL),
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    text = Path(RESNET).read_text().replace("max_size: 64", "max_size: 16")
    path = tmp_path_factory.mktemp("resnet") / "resnet50.yaml"
    path.write_text(text)
    return load_pipeline(path)


@pytest.fixture(scope="module")
def items(pipeline):
    got = sample_items(pipeline, 45, seed=5)
    got[7] = ("corrupt", {"image": b"\xff\xd8\xff\xe0 truncated"})
    return got


@pytest.fixture(scope="module")
def want(pipeline, items):
    return nicoffload.run(pipeline, items, plan=single_device_plan(pipeline), workers=4)


@pytest.mark.parametrize("what", list(SHAPES))
def test_a_gpu_stage_anywhere_matches_the_all_host_run(gpu, pipeline, items, want, what) -> None:
    placement, tol = SHAPES[what]
    topo = local_topology(emulate_dpu="dpu0" in placement.values(), gpu=True)
    if "dpu0" in placement.values() and "dpu0" not in topo.ids:
        pytest.skip("one core: no emulated DPU")
    plan = plan_of(pipeline, placement, topology="local")
    assert not fast_path(plan)
    with nicoffload.open(pipeline, plan, topo, workers=4) as s:
        assert isinstance(s.executor, Chain)
        for _ in range(2):  # a session's second call runs as its first
            got = s.run(items)
            assert got.names == want.names
            assert got.ok.tolist() == want.ok.tolist() and not got.ok[7]
            assert [f.index for f in got.failures] == [7]
            assert got.stats.failover is None
            pixels = got.outputs["pixels"].astype(np.float32)
            assert pixels.shape == want.outputs["pixels"].shape
            assert not pixels[7].any()
            diff = np.abs(pixels - want.outputs["pixels"])[got.ok]
            assert diff.mean() <= tol, what
    on_gpu = plan.stages[-1].kind == "gpu"
    assert got.torch()["pixels"].is_cuda is on_gpu
    gpu_stages = [st for st in plan.stages if st.kind == "gpu"]
    for st in gpu_stages:
        assert got.stats.stages[st.name]["ms_per_item"] > 0
