"""The ingress checks a REQUEST frame's keys and kinds once, on one item (`check_kinds`: every
item of a frame has the frame's meta's), and each item's tensors alone (`check_tensors`): for
every item, the pair says what `check_values` says of it."""

from __future__ import annotations

import numpy as np
import pytest
from test_agent_tensor_inputs import HOST_DPU, built_of, round_trip

from dpu_agents.config import AgentConfig
from dpu_agents.stageinputs import check_kinds, check_tensors, check_values, tensor_inputs


def verdict(check, *args) -> str:
    try:
        check(*args)
    except ValueError as exc:
        return str(exc)
    return "ok"


def image(h: int = 300, w: int = 400, c: int = 3) -> np.ndarray:
    return np.zeros((h, w, c), np.uint8)


FRAMES = {
    "every item right": [{"decode": image()}, {"decode": image(280, 420)}],
    "one item's tensor wrong": [{"decode": image()}, {"decode": image(c=4)}],
    "one item over max_pixels": [{"decode": image(500, 400)}, {"decode": image()}],
    "bytes where a tensor is read": [{"decode": b"\xff\xd8\xff"}, {"decode": b"\xff\xd8"}],
    "a key the stage does not read": [{"image": b"\xff\xd8\xff"}, {"image": b"\xff"}],
}


@pytest.mark.parametrize("frame", list(FRAMES))
def test_a_frame_checked_once_and_per_tensor_fails_the_items_check_values_fails(frame) -> None:
    built = built_of(HOST_DPU, AgentConfig(max_pixels=150_000))
    items = round_trip(FRAMES[frame])  # as the agent splits the frame it read
    shared = verdict(check_kinds, built.inputs, items[0])
    tensors = tensor_inputs(built.inputs)
    for values in items:
        mine = shared if shared != "ok" else verdict(check_tensors, tensors, values)
        assert mine == verdict(check_values, built.inputs, values)
    verdicts = [verdict(check_values, built.inputs, v) for v in items]
    assert (verdicts == ["ok", "ok"]) == (frame == "every item right")  # the others fail some
