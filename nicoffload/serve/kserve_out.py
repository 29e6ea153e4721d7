"""The Open Inference Protocol's responses (KServe v2, HTTP/REST with Triton's binary-tensor
extension): outputs encoded as binary data or JSON, the response's body and headers, error
bodies, and the model metadata a pipeline's tensors make. The requests' side is `kserve`.

Pure functions of values, as `kserve`: the body is the JSON header, then each binary output's
bytes in the order the outputs are listed (`Inference-Header-Content-Length` says where the
header ends).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from nicoffload.graph import Pipeline, TensorSpec
from nicoffload.serve.kserve import HEADER_LENGTH, InferRequest, datatype_of, pack_bytes


def _elements(arr: np.ndarray) -> list[bytes]:
    return [e if isinstance(e, bytes) else str(e).encode() for e in arr.reshape(-1).tolist()]


def encode_raw(arr: np.ndarray, copy: bool = True) -> tuple[str, bytes | memoryview]:
    """An output's datatype and raw bytes (the binary extension's, or gRPC's
    raw_output_contents): BYTES elements length-prefixed, any other datatype little-endian.
    Not `copy`: a view of `arr`'s own bytes where they are already those (valid as long as
    `arr` is)."""
    datatype = datatype_of(arr.dtype)
    if datatype == "BYTES":
        return datatype, pack_bytes(_elements(arr))
    raw = np.ascontiguousarray(arr, arr.dtype.newbyteorder("<"))
    return datatype, raw.tobytes() if copy else memoryview(raw.reshape(-1).view(np.uint8))


def _tensor_json(
    name: str, arr: np.ndarray, binary: bool, copy: bool
) -> tuple[dict[str, Any], bytes | memoryview | None]:
    datatype = datatype_of(arr.dtype)
    out: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
    if binary:
        _, raw = encode_raw(arr, copy)
        out["parameters"] = {"binary_data_size": len(raw)}
        return out, raw
    if datatype == "BYTES":
        out["data"] = [e.decode("utf-8", "replace") for e in _elements(arr)]
    else:
        out["data"] = arr.reshape(-1).tolist()
    return out, None


def answered_outputs(req: InferRequest, outputs: Mapping[str, Any]) -> list[str]:
    """The outputs a response carries: those the request names, or all of them."""
    return list(outputs) if req.outputs is None else list(req.outputs)


def infer_response(
    model: str,
    req: InferRequest,
    outputs: Mapping[str, np.ndarray],
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers: the requested outputs (all, when none were named),
    each binary when the request asks (`binary_data_output`, or the output's `binary_data`)."""
    return assemble_response(response_parts(model, req, outputs), parameters)


def response_parts(
    model: str, req: InferRequest, outputs: Mapping[str, np.ndarray], copy: bool = True
) -> tuple[dict[str, Any], list[bytes | memoryview]]:
    """The costly half of `infer_response`: the response's JSON document (without its
    parameters) and the outputs' binary blobs, so that the time it takes can be among the
    parameters `assemble_response` then adds. Not `copy`: the blobs are views of the outputs
    where they can be, which must stay as they are until `assemble_response` has copied them
    into the body (one copy of each output, not two)."""
    names = answered_outputs(req, outputs)
    doc: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": []}
    if req.id is not None:
        doc["id"] = req.id
    blobs: list[bytes | memoryview] = []
    for name in names:
        binary = (
            req.binary_output if req.outputs is None else req.outputs[name] or req.binary_output
        )
        entry, raw = _tensor_json(name, np.asarray(outputs[name]), binary, copy)
        doc["outputs"].append(entry)
        if raw is not None:
            blobs.append(raw)
    return doc, blobs


def assemble_response(
    parts: tuple[dict[str, Any], list[bytes | memoryview]],
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """`response_parts`' document with `parameters`, and its blobs: the body and headers."""
    doc, blobs = parts
    if parameters:
        doc = {**doc, "parameters": dict(parameters)}
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return b"".join([head, *blobs]), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(head)),
    }


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def tensor_metadata(name: str, spec: TensorSpec) -> dict[str, Any]:
    """A pipeline tensor as the protocol's metadata: a leading -1 for the items."""
    shape = [-1] if not spec.static else [-1, *spec.shape]
    return {"name": name, "datatype": datatype_of(spec.dtype), "shape": shape}


def model_metadata(
    name: str, pipeline: Pipeline, outputs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """`GET /v2/models/{name}`: the pipeline's inputs, and its outputs (or the model's)."""
    if outputs is None:
        outputs = [tensor_metadata(k, s) for k, s in pipeline.output_specs().items()]
    return {
        "name": name,
        "versions": ["1"],
        "platform": "nicoffload",
        "inputs": [tensor_metadata(k, s) for k, s in pipeline.inputs.items()],
        "outputs": outputs,
    }
