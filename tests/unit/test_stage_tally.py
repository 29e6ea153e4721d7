"""A stage's step times counted per caller: `process(..., tally=)` adds to the caller's tally, and
`times()` sees those calls once the tally is added (the agent's workers add theirs once per
batch, not under the stage's lock per item); without a tally every call counts at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.stage import Stage

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stage() -> Stage:
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    plan = StagePlan("s0-dpu0", "dpu0", "dpu", ("decode", "resize", "crop"))
    return Stage(pipeline, plan, {"crop"})


def image() -> bytes:
    import numpy as np
    import simplejpeg

    rng = np.random.default_rng(0)
    px = rng.integers(0, 255, (30, 40, 3), np.uint8).repeat(8, 0).repeat(8, 1)
    return simplejpeg.encode_jpeg(np.ascontiguousarray(px), quality=85)


def test_calls_with_a_tally_reach_the_stage_times_when_the_tally_is_added(stage) -> None:
    before = {k: t.calls for k, t in stage.times().items()}
    tally = stage.tally()
    for _ in range(3):
        stage.process({"image": image()}, {}, tally)
    assert {k: t.calls for k, t in stage.times().items()} == before  # not yet
    assert tally.calls == [3] * len(stage.steps) and all(c > 0 for c in tally.cpu_ns)
    stage.add(tally)
    after = stage.times()
    assert {k: t.calls - before[k] for k, t in after.items()} == dict.fromkeys(after, 3)
    assert all(t.cpu_ms > 0 and t.wall_ms > 0 for t in after.values())


def test_a_call_without_a_tally_counts_at_once(stage) -> None:
    before = {k: t.calls for k, t in stage.times().items()}
    values = {"image": image()}
    stage.process(values, {})
    assert values["crop"].shape == (224, 224, 3)
    assert {k: t.calls - before[k] for k, t in stage.times().items()} == {
        "decode": 1,
        "resize+crop": 1,
    }
