"""The all-GPU plan on the GPU, through a Session: batches handed whole to the GPU stage
(`runtime/gpu_direct.py`), CUDA outputs handed over as the stage made them, progressive JPEGs
still decoded on host threads, and many calls on one session."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import nicoffload
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.samples import sample_images

PIPELINE = dataclasses.replace(load_pipeline("pipelines/resnet50.yaml"), batch_max_size=16)
DECODE_TOL = 0.05  # nvJPEG against libjpeg-turbo, after normalize (as test_gpu_executor)


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    got = [b for _, b in sample_images(70, seed=11)]
    got[9] = b"\xff\xd8\xff\xe0 truncated"
    return got


@pytest.fixture(scope="module")
def host(images):
    return nicoffload.run(PIPELINE, images, plan=single_device_plan(PIPELINE, "cpu"))


def test_an_all_gpu_session_runs_batches_whole_and_matches_the_host(gpu, images, host):
    with nicoffload.open(PIPELINE, single_device_plan(PIPELINE, "gpu0")) as session:
        assert session.executor.direct is not None
        first = session.run(images)
        batches = list(session.stream(images))
        stats = session.executor.gpu.stage.steps[0].fn.stats
    again = np.concatenate([b.numpy().outputs["pixels"] for b in batches])
    for got in (first.outputs["pixels"], again):
        assert got.shape == (70, 3, 224, 224)
        diff = np.abs(got.astype(np.float32) - host.outputs["pixels"])
        assert diff[host.ok].mean() <= DECODE_TOL
        assert not got[9].any()
    assert first.ok.tolist() == host.ok.tolist() and not first.ok[9]
    assert [(f.index, f.reason) for f in first.failures] == [
        (f.index, f.reason) for f in host.failures
    ]
    assert [len(b) for b in batches] == [16, 16, 16, 16, 6]
    assert all(b.outputs["pixels"].is_cuda for b in batches)
    assert stats.cpu_progressive > 0 and stats.gpu > 0  # the sample corpus has progressive JPEGs


def test_a_batch_the_caller_holds_is_not_overwritten_by_later_calls(gpu, images):
    with nicoffload.open(PIPELINE, single_device_plan(PIPELINE, "gpu0")) as session:
        stream = session.stream(images[:32])
        pixels = next(stream).outputs["pixels"]
        kept = pixels.clone()
        assert session.run(images[32:]).ok.sum() == 38  # ends the suspended stream first
        assert list(session.stream(images[16:48]))
        assert bool((pixels == kept).all())
