"""LOAD's work: the pipeline built from its YAML text (never unpickled), the plan's stage checked
and bound to the DPU kernels, the values it reads (pipeline inputs, or values leaving earlier
stages: `stageinputs`) and the values that leave it (what gets forwarded).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dpu_agents.stageinputs import StageInput, stage_inputs
from nicoffload.agent.protocol import OutputMeta
from nicoffload.errors import AgentError, NicoffloadError, UserError
from nicoffload.graph import Pipeline, TensorSpec, load_pipeline
from nicoffload.p4.ids import pipeline_id, stage_ids
from nicoffload.planner.physical import leaving
from nicoffload.planner.plan import Plan
from nicoffload.runtime.stage import Stage
from nicoffload.transport.frame import DType

if TYPE_CHECKING:
    from dpu_agents.config import AgentConfig

MAX_BATCH = 4096
MAX_WAIT_MS = 10_000.0
LOADED_FILE = "<pipeline of the LOAD>"  # what the client's errors name instead of a temp path


@dataclass(frozen=True)
class Built:
    pipeline: Pipeline
    stage: Stage
    out_specs: dict[str, TensorSpec]  # value key -> spec, for every value leaving the stage
    batch_max_size: int
    batch_max_wait_s: float
    inputs: dict[str, StageInput]  # value key -> what each request item carries of it
    pipeline_id: int = 0  # stamped in the forwarded frames' headers: what the NIC steers on
    next_stage_id: int = 0

    def slot_bytes(self) -> int:
        """One batch slot: the batch size x the bytes of the static values forwarded per item
        (values of varying shape are held per row, in the decode budget)."""
        return self.batch_max_size * sum(_nbytes(s) for s in self.out_specs.values())

    def outputs(self) -> tuple[OutputMeta, ...]:
        return tuple(
            OutputMeta(k, s.dtype, tuple(s.shape) if s.static else None)  # type: ignore[arg-type]
            for k, s in self.out_specs.items()
        )


def pipeline_from_text(text: str, tokenizer_dir: str = "") -> Pipeline:
    """Build a Pipeline from YAML text; a file parameter (the tokenizer) is an id, a shipped
    name (`bert-base-uncased`) or a file of the operator's `tokenizer_dir`, never a path the
    client names. Errors point into the text as LOADED_FILE."""
    with tempfile.TemporaryDirectory(prefix="nicoffload-agent-") as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            return load_pipeline(path, tokenizer_dir)
        except UserError as exc:
            if exc.mark is None or exc.mark.file != str(path):
                raise
            mark = dataclasses.replace(exc.mark, file=LOADED_FILE)
            raise type(exc)(exc.message, mark) from None


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * spec.itemsize if spec.static else 0  # type: ignore[arg-type]


def check_limits(
    nodes: list, out_specs: dict[str, TensorSpec], batch_max_size: int, limits: AgentConfig
) -> None:
    """What the operator's config allows a LOAD to ask, checked before a byte is allocated:
    the decoders' max_pixels, every node's per-item values, the batch and its slot."""
    if batch_max_size > limits.max_batch:
        raise AgentError(
            f"batch_max_size {batch_max_size} is more than this agent allows "
            f"(max_batch = {limits.max_batch})"
        )
    for node in nodes:
        where = f"{LOADED_FILE}:{node.mark.line}:{node.mark.column}: node '{node.name}'"
        asked = node.params.get("max_pixels") if node.op == "decode_image" else None
        if asked is not None and asked > limits.max_pixels:
            raise AgentError(
                f"{where}: max_pixels {asked} is more than this agent allows "
                f"(max_pixels = {limits.max_pixels}); set max_pixels: {limits.max_pixels} or less"
            )
        for port, spec in node.out_specs.items():
            if _nbytes(spec) > limits.max_value_bytes:
                raise AgentError(
                    f"{where}: its {port} value ({spec}) is {_nbytes(spec)} bytes an item, more "
                    f"than this agent allows (max_value_bytes = {limits.max_value_bytes})"
                )
    slot = batch_max_size * sum(_nbytes(s) for s in out_specs.values())
    if slot > limits.max_slot_bytes:
        raise AgentError(
            f"a batch of {batch_max_size} of the stage's outputs is {slot} bytes, more than this "
            f"agent allows (max_slot_bytes = {limits.max_slot_bytes}): lower the batch size"
        )


def build_stage(
    yaml_text: str,
    plan_text: str,
    stage_name: str,
    batch_max_size: int,
    batch_max_wait_ms: float,
    limits: AgentConfig | None = None,
) -> Built:
    """Everything LOAD needs before it connects the sender; AgentError says what is wrong.
    `limits`: the operator's bounds (`check_limits`), checked before the kernels are built."""
    if not 1 <= batch_max_size <= MAX_BATCH:
        raise AgentError(f"batch_max_size must be in 1..{MAX_BATCH}, got {batch_max_size}")
    if not 0 <= batch_max_wait_ms <= MAX_WAIT_MS:
        raise AgentError(f"batch_max_wait_ms must be in 0..{MAX_WAIT_MS}, got {batch_max_wait_ms}")
    try:
        pipeline = pipeline_from_text(yaml_text, limits.tokenizer_dir if limits else "")
        plan = Plan.from_json(json.loads(plan_text), "<plan from the client>")
        plan.check_matches(pipeline)
    except json.JSONDecodeError as exc:
        raise AgentError(f"the plan is not JSON: {exc}") from None
    except NicoffloadError as exc:
        raise AgentError(f"cannot load the stage: {exc}") from None
    stages = {s.name: s for s in plan.stages}
    sp = stages.get(stage_name)
    if sp is None:
        raise AgentError(f"the plan has no stage {stage_name!r} (it has {sorted(stages)})")
    if sp.kind != "dpu":
        raise AgentError(f"stage {stage_name!r} is placed on {sp.device} ({sp.kind}), not a DPU")
    nodes = [pipeline.node(n) for n in sp.nodes]
    inputs = stage_inputs(pipeline, sp, limits)
    out_specs: dict[str, TensorSpec] = {}
    for key in leaving(pipeline, sp):  # what the host side expects back, in its order
        name, _, port = key.partition(".")
        spec = pipeline.node(name).out_specs[port or "out"]
        if spec.dtype in ("bytes", "str"):
            raise AgentError(f"value '{key}' ({spec}) cannot be forwarded as a tensor")
        try:
            DType.of(spec.dtype)
        except ValueError as exc:
            raise AgentError(f"value '{key}': {exc}") from None
        out_specs[key] = spec
    if limits is not None:
        check_limits(nodes, out_specs, batch_max_size, limits)
    try:
        stage = Stage(pipeline, sp, set(out_specs))
    except NicoffloadError as exc:
        raise AgentError(f"cannot bind stage {stage_name!r}: {exc}") from None
    ids = stage_ids(plan)
    order = [s.name for s in plan.stages]
    after = order[order.index(stage_name) + 1] if order.index(stage_name) + 1 < len(order) else None
    next_id = ids[after] if after is not None else ids.get("egress", 0)
    return Built(
        pipeline,
        stage,
        out_specs,
        batch_max_size,
        batch_max_wait_ms / 1000,
        inputs,
        pipeline_id(plan.pipeline),
        next_id,
    )
