"""The Open Inference Protocol's gRPC messages (KServe v2's `GRPCInferenceService`, the
protobuf classes tritonclient[grpc] ships) to and from the codec's values: a ModelInferRequest
into the same `InferRequest` the HTTP endpoint parses, outputs into a ModelInferResponse.

Pure functions of messages and values; the checks (datatype, shape, BYTES framing, sizes) are
`kserve`'s, so both endpoints refuse the same requests with the same reasons.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nicoffload.serve import kserve, kserve_out
from nicoffload.serve.kserve import InferRequest, RequestError, Tensor

# a datatype's field of InferTensorContents (FP16 has none: it comes raw only)
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def pb() -> Any:
    """tritonclient's generated service_pb2 (the extra 'grpc')."""
    try:
        from tritonclient.grpc import service_pb2
    except ImportError as exc:
        from nicoffload.errors import MissingDependency

        raise MissingDependency("tritonclient[grpc]", "grpc", "serve --grpc") from exc
    return service_pb2


def parameter(p: Any) -> Any:
    """An InferParameter's value (None when none of its fields is set)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _contents(t: Any, datatype: str, shape: tuple[int, ...]) -> Tensor:
    field = CONTENTS.get(datatype)
    if field is None:
        raise RequestError(f"input '{t.name}': {datatype} comes in raw_input_contents only")
    values = list(getattr(t.contents, field))
    if len(values) != math.prod(shape):
        raise RequestError(
            f"input '{t.name}': {len(values)} elements in contents.{field} for shape "
            f"{list(shape)} ({math.prod(shape)})"
        )
    if datatype == "BYTES":
        return Tensor(t.name, datatype, shape, values)
    arr = np.asarray(values, dtype=kserve.DATATYPES[datatype]).reshape(shape)
    return Tensor(t.name, datatype, shape, arr)


def infer_request(msg: Any, max_items: int | None = None) -> InferRequest:
    """A ModelInferRequest as the codec's InferRequest; outputs are always raw (binary). A
    BYTES input of more than `max_items` elements is refused before its elements are read."""
    raw = list(msg.raw_input_contents)
    if raw and len(raw) != len(msg.inputs):
        raise RequestError(
            f"{len(raw)} raw_input_contents for {len(msg.inputs)} inputs (one each, or none)"
        )
    if not msg.inputs:
        raise RequestError("'inputs' must be a non-empty list")
    inputs: dict[str, Tensor] = {}
    for i, t in enumerate(msg.inputs):
        if not t.name:
            raise RequestError("an input lacks its 'name'")
        dtype = kserve.check_datatype(t.name, t.datatype)
        shape = kserve.check_shape(list(t.shape), t.name)
        kserve.check_count(t.name, math.prod(shape), max_items, dtype)
        if raw:
            tensor = kserve.decode_raw(t.name, t.datatype, shape, raw[i])
        else:
            tensor = _contents(t, t.datatype, shape)
        if t.name in inputs:
            raise RequestError(f"input '{t.name}' given twice")
        inputs[t.name] = tensor
    params = {k: parameter(v) for k, v in msg.parameters.items()}
    outputs = {o.name: True for o in msg.outputs} or None
    return InferRequest(msg.id or None, inputs, params, outputs, binary_output=True)


def infer_response(
    model: str,
    req: InferRequest,
    outputs: Mapping[str, np.ndarray],
    parameters: Mapping[str, int | str] | None = None,
) -> Any:
    """A ModelInferResponse: the outputs the request names (or all), each in
    raw_output_contents; the timing breakdown as its parameters (`add_parameters`)."""
    service_pb2 = pb()
    resp = service_pb2.ModelInferResponse(model_name=model, model_version="1", id=req.id or "")
    for name in kserve_out.answered_outputs(req, outputs):
        arr = np.asarray(outputs[name])
        datatype, data = kserve_out.encode_raw(arr)
        resp.outputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        resp.raw_output_contents.append(data)
    return add_parameters(resp, parameters or {})


def add_parameters(resp: Any, parameters: Mapping[str, bool | int | str]) -> Any:
    """`resp` with `parameters` set: a whole number as int64_param, a string as string_param,
    a bool as bool_param (the time encoding took can be among them: they go in after)."""
    for k, v in parameters.items():
        if isinstance(v, bool):
            resp.parameters[k].bool_param = v
        elif isinstance(v, str):
            resp.parameters[k].string_param = v
        else:
            resp.parameters[k].int64_param = int(v)
    return resp


def model_metadata(meta: Mapping[str, Any]) -> Any:
    """The HTTP endpoint's model metadata (`kserve_out.model_metadata`) as a ModelMetadataResponse."""
    service_pb2 = pb()
    tensor = service_pb2.ModelMetadataResponse.TensorMetadata
    return service_pb2.ModelMetadataResponse(
        name=meta["name"],
        versions=meta["versions"],
        platform=meta["platform"],
        inputs=[tensor(**t) for t in meta["inputs"]],
        outputs=[tensor(**t) for t in meta["outputs"]],
    )
