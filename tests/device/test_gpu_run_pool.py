"""`Session.run` of a plan that ends on the GPU: a whole call's outputs come down into
page-locked rows the session keeps (one DMA per batch, no host copy), reused only once no
earlier result, or view of one, still holds them (`session.Staging.pooled`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import nicoffload
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.samples import sample_images

PIPELINE = dataclasses.replace(load_pipeline("pipelines/resnet50.yaml"), batch_max_size=16)


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [b for _, b in sample_images(40, seed=13)]


@pytest.fixture(scope="module")
def session(gpu):
    with nicoffload.open(PIPELINE, single_device_plan(PIPELINE, "gpu0")) as s:
        yield s


def pool_of(session) -> np.ndarray:
    return session._staging._pool["pixels"][1]


def test_a_dropped_result_leaves_its_rows_to_the_next_call(session, images):
    first = session.run(images).outputs["pixels"].copy()
    again = session.run(images[:20] + images[20:])  # the first result was dropped
    assert np.shares_memory(again.outputs["pixels"], pool_of(session))
    np.testing.assert_array_equal(again.outputs["pixels"], first)


def test_a_result_kept_is_never_overwritten_by_a_later_call(session, images):
    kept = session.run(images[:24])
    want = kept.outputs["pixels"].copy()
    other = session.run(images[16:])  # other items: they would overwrite shared rows
    assert not np.shares_memory(other.outputs["pixels"], kept.outputs["pixels"])
    np.testing.assert_array_equal(kept.outputs["pixels"], want)


def test_a_view_kept_of_a_dropped_result_holds_its_rows_too(session, images):
    view = session.run(images[:24]).outputs["pixels"][3:7]
    want = view.copy()
    session.run(images[10:34])
    np.testing.assert_array_equal(view, want)
