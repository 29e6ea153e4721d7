"""What a loaded stage reads from each REQUEST item: pipeline inputs (bytes, text) and values
leaving earlier stages (tensors, keyed as the host keys them: "decode", "tok.input_ids"), each
with the spec it must match and the bounds the operator allows. Bounds are fixed at LOAD;
per item, a value that does not match fails that item alone (`bad_request`), never the session.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from nicoffload.errors import AgentError
from nicoffload.graph import Pipeline, TensorSpec
from nicoffload.planner.plan import StagePlan
from nicoffload.transport.frame import DType

if TYPE_CHECKING:
    from dpu_agents.config import AgentConfig


@dataclass(frozen=True)
class StageInput:
    """One value a stage reads from outside it. For a tensor: `max_bytes` bounds an item's
    value of dynamic shape, `max_pixels` (0: none) its first two dims' product when a
    decode_image node made it, as an image decoded here is bounded."""

    key: str
    spec: TensorSpec
    max_bytes: int = 0
    max_pixels: int = 0

    @property
    def kind(self) -> str:
        return {"str": "text", "bytes": "bytes"}.get(self.spec.dtype, "tensor")


def stage_inputs(
    pipeline: Pipeline, stage: StagePlan, limits: AgentConfig | None
) -> dict[str, StageInput]:
    """The value keys the stage's nodes read from outside it, in the order they first read
    them; AgentError for one the agent could not take (a dtype the wire has no code for, a
    static value larger than the operator's max_value_bytes)."""
    from dpu_agents.config import AgentConfig

    limits = limits or AgentConfig()
    inside = set(stage.nodes)
    out: dict[str, StageInput] = {}
    for name in stage.nodes:
        for ref in pipeline.node(name).inputs:
            key = str(ref)
            if key in out or (not ref.is_input and ref.source in inside):
                continue
            spec = pipeline.spec_of(ref)
            if spec.dtype in ("bytes", "str"):
                out[key] = StageInput(key, spec)
                continue
            try:
                DType.of(spec.dtype)
            except ValueError as exc:
                raise AgentError(f"node '{name}' reads '{key}': {exc}") from None
            if spec.static and math.prod(spec.shape) * spec.itemsize > limits.max_value_bytes:  # type: ignore[arg-type]
                raise AgentError(
                    f"node '{name}' reads '{key}' ({spec}): more than this agent allows an "
                    f"item (max_value_bytes = {limits.max_value_bytes})"
                )
            pixels = 0
            if not ref.is_input and pipeline.node(ref.source).op == "decode_image":
                made = pipeline.node(ref.source).params["max_pixels"]
                pixels = min(made, limits.max_pixels)
            out[key] = StageInput(key, spec, limits.max_value_bytes, pixels)
    return out


def check_values(inputs: Mapping[str, StageInput], values: Mapping[str, Any]) -> None:
    """ValueError (the item's `bad_request`) unless `values` holds exactly the stage's inputs,
    each of its kind; a tensor of its spec's dtype and rank, its static dims, within bounds."""
    check_kinds(inputs, values)
    check_tensors(tensor_inputs(inputs), values)


def check_kinds(inputs: Mapping[str, StageInput], values: Mapping[str, Any]) -> None:
    """The part of `check_values` a REQUEST frame's items share (their keys and kinds come
    from the frame's meta): checked on one item, it holds for every item of the frame."""
    if set(values) != set(inputs):
        raise ValueError(f"inputs {sorted(values)}, the stage reads {sorted(inputs)}")
    for key, want in inputs.items():
        v = values[key]
        got = "text" if isinstance(v, str) else "tensor" if isinstance(v, np.ndarray) else "bytes"
        # bytes for a text: the tokenizer reads them as utf-8 (else `bad_text`), as on the host
        if got != want.kind and (got, want.kind) != ("bytes", "text"):
            raise ValueError(f"input {key!r} must be {want.kind} ({want.spec}), got {got}")


def tensor_inputs(inputs: Mapping[str, StageInput]) -> tuple[StageInput, ...]:
    return tuple(i for i in inputs.values() if i.kind == "tensor")


def check_tensors(tensors: tuple[StageInput, ...], values: Mapping[str, Any]) -> None:
    """The per-item rest of `check_values`, once `check_kinds` held: each tensor's dtype,
    rank, static dims and bounds (`tensors`: `tensor_inputs` of the stage)."""
    for want in tensors:
        _check_tensor(want, values[want.key])


def _check_tensor(want: StageInput, v: np.ndarray) -> None:
    spec = want.spec
    if v.dtype != np.dtype(spec.dtype) or v.ndim != len(spec.shape):
        raise ValueError(f"input {want.key!r} must be {spec}, got {v.dtype}{list(v.shape)}")
    for i, (d, n) in enumerate(zip(spec.shape, v.shape, strict=True)):
        if isinstance(d, int) and d != n:
            raise ValueError(
                f"input {want.key!r} must be {spec}, got {v.dtype}{list(v.shape)} (dim {i})"
            )
    if v.nbytes > want.max_bytes:
        raise ValueError(
            f"input {want.key!r}: {v.dtype}{list(v.shape)} is {v.nbytes} bytes, more than this "
            f"agent allows an item (max_value_bytes = {want.max_bytes})"
        )
    if want.max_pixels and v.ndim >= 2 and v.shape[0] * v.shape[1] > want.max_pixels:
        raise ValueError(
            f"input {want.key!r}: {v.shape[1]}x{v.shape[0]} pixels is more than "
            f"max_pixels={want.max_pixels}"
        )
