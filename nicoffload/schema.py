"""The JSON Schema of pipeline files, generated from the op registry (so it cannot drift)."""

from __future__ import annotations

from typing import Any

from nicoffload import ops
from nicoffload.spec import DEVICE_KINDS, INPUT_KINDS


def _node_schema(opdef: ops.OpDef) -> dict[str, Any]:
    required = [p.name for p in opdef.params if p.default is ops.REQUIRED]
    params: dict[str, Any] = {
        "type": "object",
        "properties": {p.name: p.json_schema() for p in opdef.params},
        "additionalProperties": False,
    }
    if required:
        params["required"] = required
    return {
        "if": {"properties": {"op": {"const": opdef.name}}},
        "then": {
            "properties": {"params": params},
            **({"required": ["params"]} if required else {}),
        },
    }


def pipeline_schema() -> dict[str, Any]:
    names = ops.op_names()
    ref = {"type": "string", "description": "an input name, a node name, or node.output"}
    node = {
        "type": "object",
        "required": ["name", "op", "in"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string"},
            "op": {"enum": names},
            "in": {"oneOf": [ref, {"type": "array", "items": ref, "minItems": 1}]},
            "params": {"type": "object"},
        },
        "allOf": [_node_schema(ops.get_op(n)) for n in names],  # type: ignore[arg-type]
    }
    pos_int = {"type": "integer", "minimum": 1}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "nicoffload pipeline",
        "type": "object",
        "required": ["inputs", "nodes", "outputs"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string"},
            "description": {"type": "string"},
            "inputs": {
                "type": "object",
                "minProperties": 1,
                "additionalProperties": {
                    "type": "object",
                    "required": ["kind"],
                    "additionalProperties": False,
                    "properties": {
                        "kind": {"enum": list(INPUT_KINDS)},
                        "format": {"type": "string"},
                        "typical": {
                            "type": "object",
                            "properties": {
                                # the share of the items that are progressive JPEGs
                                "progressive": {"type": "number", "minimum": 0, "maximum": 1},
                                # and that a GPU decoder leaves to the host
                                "host_decoded": {"type": "number", "minimum": 0, "maximum": 1},
                            },
                            "additionalProperties": pos_int,
                        },
                    },
                },
            },
            "nodes": {"type": "array", "minItems": 1, "items": node},
            "outputs": {"type": "object", "minProperties": 1, "additionalProperties": ref},
            "batch": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "max_size": pos_int,
                    "max_wait_ms": {"type": "number", "exclusiveMinimum": 0},
                },
            },
            "placement": {
                "type": "object",
                "additionalProperties": {
                    "oneOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    ]
                },
                "description": f"allowed devices per node: kinds {list(DEVICE_KINDS)} or device ids",
            },
            "slo": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "latency_ms": {"type": "number"},
                    "throughput_per_s": {"type": "number"},
                },
            },
        },
    }
