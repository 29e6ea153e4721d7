"""The Open Inference Protocol (KServe v2, HTTP/REST) with Triton's binary-tensor extension:
infer requests parsed and checked against a pipeline's inputs, the datatypes and the BYTES
framing both directions share; the responses' side (outputs, metadata, error bodies) is
`kserve_out`.

Pure functions of bytes and values: no sockets, no clock. A request that is wrong raises
`RequestError` carrying the HTTP status and the reason the client gets in `{"error": ...}`.
Binary data: the JSON header is the first `Inference-Header-Content-Length` bytes of the body,
then each tensor with `parameters.binary_data_size` in the order the tensors are listed; a BYTES
tensor is its elements back to back, each a 4-byte little-endian length and the bytes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.graph import Pipeline

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPES = ("application/json",)
BINARY_TYPES = ("application/octet-stream", "application/vnd.triton.binary+json")

# KServe v2 datatypes and their numpy dtypes (little-endian on the wire); BYTES: an object array
DATATYPES: dict[str, np.dtype | None] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": None,
}
_BY_KIND = {(dt.kind, dt.itemsize): name for name, dt in DATATYPES.items() if dt is not None}


# A JSON tensor (a request's `data`, or a response's output not asked for as binary) is at most
# this many elements: encoding and parsing them is Python holding the GIL (about 1 s per
# million numbers here), which would stall every other request and the agent's heartbeats.
MAX_JSON_ELEMENTS = 1 << 18
MAX_DIM = (1 << 31) - 1  # a shape's dimension
MAX_TIMEOUT_US = 86_400 * 10**6  # a day


class RequestError(Exception):
    """A request the server refuses: `status` (4xx) and the reason, sent as `{"error": ...}`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Tensor:
    """One input tensor of a request: its elements (a numpy array; BYTES: a list of bytes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: dict[str, Tensor]
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, bool] | None = None  # requested output -> binary; None: every output
    binary_output: bool = False  # the request-level `binary_data_output`

    @property
    def timeout_us(self) -> int | None:
        """Triton's `timeout` request parameter (microseconds), or None."""
        t = self.parameters.get("timeout")
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TIMEOUT_US:
            raise RequestError(
                "parameter 'timeout' must be a whole number of microseconds from 0 to "
                f"{MAX_TIMEOUT_US} (a day), got {str(t)[:40]!r}"
            )
        return t or None  # 0: no timeout, as in Triton


def datatype_of(dtype: np.dtype | str) -> str:
    """The KServe datatype of a numpy dtype ("BYTES" for bytes, str and object)."""
    dt = np.dtype(dtype) if dtype not in ("bytes", "str") else np.dtype(object)
    if dt.kind in "OSU":
        return "BYTES"
    name = _BY_KIND.get((dt.kind, dt.itemsize))
    if name is None:
        raise ValueError(f"no KServe datatype for numpy dtype {dt}")
    return name


def pack_bytes(elements: list[bytes]) -> bytes:
    """Elements of a BYTES tensor in the binary format: 4-byte LE length + bytes, each."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def unpack_bytes(buf: bytes | memoryview, count: int, name: str) -> list[bytes]:
    """`count` BYTES elements out of `buf` (all of it, exactly)."""
    view, at, out = memoryview(buf), 0, []
    for i in range(count):
        if at + 4 > len(view):
            raise RequestError(f"input '{name}': binary data truncated at element {i} (no length)")
        (n,) = struct.unpack_from("<I", view, at)
        at += 4
        if at + n > len(view):
            raise RequestError(
                f"input '{name}': binary data truncated at element {i} "
                f"(length {n}, {len(view) - at} bytes left)"
            )
        out.append(bytes(view[at : at + n]))
        at += n
    if at != len(view):
        raise RequestError(
            f"input '{name}': {len(view) - at} bytes after its {count} elements (shape and "
            "binary_data_size disagree)"
        )
    return out


def check_datatype(name: str, datatype: Any) -> np.dtype | None:
    """An input's datatype checked: its numpy dtype (None for BYTES)."""
    if datatype not in DATATYPES:
        raise RequestError(
            f"input '{name}': unknown datatype {datatype!r} (one of {', '.join(DATATYPES)})"
        )
    return DATATYPES[datatype]


def check_shape(raw: Any, name: str) -> tuple[int, ...]:
    """An input's shape checked: a list of whole numbers >= 0."""
    if (
        not isinstance(raw, list)
        or len(raw) > 32
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in raw
        )
    ):
        raise RequestError(
            f"input '{name}': 'shape' must be a list of at most 32 whole numbers from 0 to "
            f"{MAX_DIM}, got {str(raw)[:80]}"
        )
    return tuple(raw)


def check_count(name: str, count: int, max_items: int | None, dtype: np.dtype | None) -> None:
    """A BYTES input of more elements than the server takes items (--max-queue) is refused
    before any element is read (413)."""
    if dtype is None and max_items is not None and count > max_items:
        raise RequestError(
            f"input '{name}': {count} elements, more items than the server queues "
            f"(--max-queue {max_items})",
            413,
        )


def decode_raw(
    name: str, datatype: str, shape: tuple[int, ...], chunk: bytes | memoryview
) -> Tensor:
    """A tensor from its raw bytes (the binary extension's, or gRPC's raw_input_contents):
    BYTES elements length-prefixed, any other datatype little-endian, exactly its shape's size."""
    count = math.prod(shape)
    dtype = DATATYPES[datatype]
    if dtype is None:
        return Tensor(name, datatype, shape, unpack_bytes(chunk, count, name))
    if len(chunk) != count * dtype.itemsize:
        raise RequestError(
            f"input '{name}': {len(chunk)} bytes of data, not shape {list(shape)} of "
            f"{datatype} ({count * dtype.itemsize} bytes)"
        )
    return Tensor(name, datatype, shape, np.frombuffer(chunk, dtype).reshape(shape))


def _flat(data: Any) -> list[Any]:
    """JSON `data`, flat or nested row-major as the protocol allows, as one flat list."""
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    for d in data:
        out.extend(_flat(d))
    return out


def _tensor(
    raw: Any, binary: memoryview | None, at: int, max_items: int | None = None
) -> tuple[Tensor, int]:
    """One input tensor from its JSON object (and its binary data at `at`); the new offset."""
    if not isinstance(raw, dict):
        raise RequestError("each entry of 'inputs' must be an object")
    name = raw.get("name")
    if not isinstance(name, str):
        raise RequestError("an input lacks its 'name' (a string)")
    datatype = raw.get("datatype")
    dtype = check_datatype(name, datatype)
    shape = check_shape(raw.get("shape"), name)
    count = math.prod(shape)
    check_count(name, count, max_items, dtype)
    params = raw.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError(f"input '{name}': 'parameters' must be an object")
    size = params.get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise RequestError(f"input '{name}': binary_data_size must be a whole number >= 0")
        if "data" in raw:
            raise RequestError(f"input '{name}': both 'data' and binary_data_size")
        if binary is None or at + size > len(binary):
            left = 0 if binary is None else len(binary) - at
            raise RequestError(
                f"input '{name}': body truncated: binary_data_size {size}, {left} bytes left"
            )
        return decode_raw(name, datatype, shape, binary[at : at + size]), at + size
    if "data" not in raw:
        raise RequestError(f"input '{name}': no 'data' and no binary_data_size")
    if count > MAX_JSON_ELEMENTS:
        raise RequestError(
            f"input '{name}': {count} elements as JSON 'data', more than {MAX_JSON_ELEMENTS}: "
            "send it as binary data (binary_data_size)",
            413,
        )
    try:
        flat = _flat(raw["data"])
    except RecursionError:
        raise RequestError(f"input '{name}': 'data' nested too deep") from None
    if len(flat) != count:
        raise RequestError(
            f"input '{name}': {len(flat)} elements in 'data' for shape {list(shape)} ({count})"
        )
    if dtype is None:
        if not all(isinstance(e, str) for e in flat):
            raise RequestError(f"input '{name}': BYTES elements in JSON 'data' must be strings")
        return Tensor(name, datatype, shape, [e.encode("utf-8", "surrogatepass") for e in flat]), at
    try:
        arr = np.asarray(flat, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RequestError(f"input '{name}': 'data' is not {datatype}: {exc}") from None
    return Tensor(name, datatype, shape, arr.reshape(shape)), at


def _requested(raw: Any) -> dict[str, bool] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RequestError("'outputs' must be a list")
    out: dict[str, bool] = {}
    for o in raw:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise RequestError("each entry of 'outputs' must be an object with a 'name'")
        params = o.get("parameters") or {}
        if not isinstance(params, dict):
            raise RequestError(f"output '{o['name']}': 'parameters' must be an object")
        out[o["name"]] = bool(params.get("binary_data", False))
    return out


def parse_infer(
    body: bytes, content_type: str, header_length: str | None, max_items: int | None = None
) -> InferRequest:
    """An infer request from its body, its Content-Type and its Inference-Header-Content-Length
    (None: the body is JSON alone); a BYTES input of more than `max_items` elements is refused
    before its elements are read."""
    # no Content-Type at all is taken: Triton's own clients send none
    ctype = content_type.split(";")[0].strip().lower()
    if header_length is None:
        if ctype and ctype not in JSON_TYPES:
            raise RequestError(
                f"Content-Type '{ctype}': a JSON request is application/json (or "
                f"give {HEADER_LENGTH} for JSON + binary data)",
                415,
            )
        head, binary = body, None
    else:
        if ctype and ctype not in (*JSON_TYPES, *BINARY_TYPES):
            raise RequestError(
                f"Content-Type '{ctype}': one of {', '.join(JSON_TYPES + BINARY_TYPES)}",
                415,
            )
        try:
            n = int(header_length)
        except ValueError:
            n = -1
        if n < 0 or n > len(body):
            raise RequestError(
                f"{HEADER_LENGTH} {header_length!r}: a whole number of bytes, at most the "
                f"body's {len(body)}"
            )
        head, binary = body[:n], memoryview(body)[n:]
    try:
        doc = json.loads(head)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError("the request's JSON is nested too deep") from None
    if not isinstance(doc, dict):
        raise RequestError("the request must be a JSON object")
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("'id' must be a string")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise RequestError("'inputs' must be a non-empty list")
    inputs: dict[str, Tensor] = {}
    at = 0
    for raw in raw_inputs:
        t, at = _tensor(raw, binary, at, max_items)
        if t.name in inputs:
            raise RequestError(f"input '{t.name}' given twice")
        inputs[t.name] = t
    if binary is not None and at != len(binary):
        raise RequestError(f"{len(binary) - at} bytes of binary data that no input claims")
    return InferRequest(
        rid, inputs, params, _requested(doc.get("outputs")), bool(params.get("binary_data_output"))
    )


def items_of(req: InferRequest, pipeline: Pipeline) -> list[dict[str, bytes | str]]:
    """The request's items for the pipeline: element i of every input is item i. Each input
    of the pipeline must be given, as BYTES of shape [N], N the same for all."""
    wanted = pipeline.inputs
    unknown = sorted(set(req.inputs) - set(wanted))
    if unknown:
        raise RequestError(
            f"unknown input '{unknown[0]}' (the model's inputs: {', '.join(wanted)})"
        )
    missing = [k for k in wanted if k not in req.inputs]
    if missing:
        raise RequestError(
            f"missing input '{missing[0]}' (the model's inputs: {', '.join(wanted)})"
        )
    counts = {}
    for name in wanted:
        t = req.inputs[name]
        if t.datatype != "BYTES":
            raise RequestError(f"input '{name}': datatype {t.datatype}, expected BYTES")
        if len(t.shape) != 1:
            raise RequestError(
                f"input '{name}': shape {list(t.shape)}, expected [N] (one element per item)"
            )
        counts[name] = t.shape[0]
    if len(set(counts.values())) != 1:
        raise RequestError(f"inputs of different lengths: {counts}")
    n = next(iter(counts.values()))
    if n == 0:
        raise RequestError("no items: the inputs' shape is [0]")
    items: list[dict[str, bytes | str]] = [{} for _ in range(n)]
    for name, spec in wanted.items():
        for i, e in enumerate(req.inputs[name].data):
            items[i][name] = _text(e, name, i) if spec.dtype == "str" else e
    return items


def _text(e: bytes, name: str, i: int) -> str:
    try:
        return e.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"input '{name}': element {i} is not UTF-8 text: {exc}") from None


def check_outputs(req: InferRequest, available: list[str]) -> None:
    """A request that asks for an output the model lacks is refused before it runs."""
    for name in req.outputs or {}:
        if name not in available:
            raise RequestError(
                f"unknown output '{name}' (the model's outputs: {', '.join(available)})"
            )


def check_json_outputs(req: InferRequest, metadata: list[dict[str, Any]], items: int) -> None:
    """A request whose JSON (not binary) outputs would pass MAX_JSON_ELEMENTS is refused
    before it runs: it should ask for them as binary data."""
    total = 0
    for o in metadata:
        name = o["name"]
        if req.outputs is not None and name not in req.outputs:
            continue
        binary = req.binary_output or bool(req.outputs and req.outputs.get(name))
        if not binary:
            total += items * math.prod(abs(d) for d in o["shape"][1:])
    if total > MAX_JSON_ELEMENTS:
        raise RequestError(
            f"the response would be {total} elements of JSON, more than {MAX_JSON_ELEMENTS}: "
            "ask for binary outputs ('binary_data_output' in the request's parameters, or "
            "'binary_data' in an output's)",
            413,
        )
