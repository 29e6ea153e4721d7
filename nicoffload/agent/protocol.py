"""The agent's control protocol: what each frame kind carries between AgentClient and agent.

Every frame is a `transport.frame` frame (64-byte header, msgpack meta, payload). The exchange:

    client                                   agent
    HELLO   {client}                    ->
                                        <-   CHALLENGE {nonce_a, agent}
    AUTH    {nonce_c, proof_c}          ->                    (wrong proof: ERROR, closed, logged)
                                        <-   WELCOME {proof_a, agent, cores, max_request_bytes}
    from here on, both ways, every frame is followed by a 16-byte MAC (GMAC; auth.session_keys,
    transport.integrity): one that fails is an ERROR and the connection closes (`bad_mac`)
    LOAD    #call {stage, forward_to, ...} + payload: pipeline YAML, plan JSON
                                        <-   ACK #call {session, window, outputs} | ERROR #call
    REQUEST request_id=first batch_size=n {names, kinds, dtypes, ndims, lengths, shapes}
            + payload: n items' values (bytes, text or tensors), back to back, each at an
            8-byte boundary (ids first .. first+n-1; one credit per frame; lengths and shapes
            checked against the header before the payload is read: a lie is a frame error;
            an item over max_request_bytes goes alone, unsent: `refused` {its size}, no
            payload, and the agent fails it as too_large)
                                        <-   CREDIT batch_size=m   (m REQUEST frames done)
    STATS / DRAIN / HEARTBEAT / SHUTDOWN #call
                                        <-   STATS / ACK / HEARTBEAT / ACK #call | ERROR #call
                                        <-   ERROR request_id=0: fatal, then the agent closes
                                        <-   DRAIN request_id=0 {reason}: the agent shuts
                                             down; it takes no new REQUEST (those that come
                                             fail as agent_draining), finishes what it has,
                                             then closes

`#call` is a call id in the header's request_id (>= 1) that the reply echoes. Outputs do not come
back on this connection: the agent forwards them to the receiver named by LOAD's `forward_to`,
proving to it the session's forward key (which both sides derive; it never crosses the wire).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from nicoffload.errors import FrameError
from nicoffload.transport.frame import DType, Header, Kind, encode, encode_meta

PROTOCOL = "nicoffload-agent/3"  # 2: a REQUEST carries a batch; 3: and tensors (RequestMeta)
MAX_LOAD_BYTES = 4 << 20  # pipeline YAML + plan JSON
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
MAX_INPUTS = 1024  # inputs of one request (a multi-camera request: 40 images + 40 captions;
# their names and lengths stay well inside MAX_META)
MAX_VALUES = 8192  # values (items x inputs) of one REQUEST frame: 32 KiB of lengths
MAX_NDIM = 8  # dims of one tensor value
MAX_SHAPE_DIMS = 4096  # dims (items x their tensors' dims) of one REQUEST frame: 16 KiB of shapes
VALUE_ALIGN = 8  # every value starts at a multiple of this in the payload: a tensor is a view
BYTES, TEXT, TENSOR = 0, 1, 2  # RequestMeta.kinds: what a value of an input is
_TENSOR_CODES = frozenset(d.value for d in DType if d is not DType.NONE)
_ELEMENTS_CAP = 1 << 32  # a tensor of more elements is past any length (uint32)
CALLS = frozenset({Kind.LOAD, Kind.STATS, Kind.DRAIN, Kind.SHUTDOWN, Kind.HEARTBEAT})


class HelloMeta(msgspec.Struct, frozen=True):
    client: str
    protocol: str = PROTOCOL


class ChallengeMeta(msgspec.Struct, frozen=True):
    nonce: bytes
    agent: str
    protocol: str = PROTOCOL


class AuthMeta(msgspec.Struct, frozen=True):
    nonce: bytes
    proof: bytes


class WelcomeMeta(msgspec.Struct, frozen=True):
    proof: bytes
    agent: str
    cores: int
    max_request_bytes: int


class LoadMeta(msgspec.Struct, frozen=True):
    """LOAD: which stage of the plan to run and where its outputs go. The payload is the
    pipeline YAML (`yaml_bytes` long) followed by the plan as JSON."""

    stage: str
    forward_to: str
    batch_max_size: int
    batch_max_wait_ms: float
    yaml_bytes: int


class OutputMeta(msgspec.Struct, array_like=True, frozen=True):
    """A value the stage forwards: static ones as one (n, *shape) array, others per item."""

    key: str
    dtype: str
    shape: tuple[int, ...] | None  # None: varies per item, sent as f"{key}@{row}"


class LoadAck(msgspec.Struct, frozen=True):
    session: str
    window: int  # REQUEST credits the client starts with
    outputs: tuple[OutputMeta, ...]
    inputs: tuple[str, ...] = ()  # the value keys each REQUEST item must carry, no others


class RequestMeta(msgspec.Struct, array_like=True, frozen=True):
    """REQUEST: a batch of items with the same inputs (k = len(names)).

    Per input j: `kinds[j]` (BYTES, TEXT: utf-8, a str on the agent, or TENSOR), and for a
    TENSOR its `dtypes[j]` (a `DType` code) and `ndims[j]` (0..MAX_NDIM); both 0 otherwise.
    `lengths`: one little-endian uint32 per item and input, item-major: item i's value of
    input j is the (i * k + j)-th value of the payload. Each value takes its length rounded up
    to VALUE_ALIGN bytes (zeros after it, ignored), so every value starts aligned. `shapes`:
    little-endian uint32 dims, item-major, of item i's tensor inputs in input order, ndims[j]
    each, none 0; a tensor's length is its dims' product x its itemsize (C order).

    `refused` (0: none): the frame is one item the client did not send, its values taking
    that many payload bytes, more than WELCOME's max_request_bytes; its lengths are 0, its
    shapes its tensors' own, the payload empty, and the agent fails it as `too_large` (in
    order, as any failed item is forwarded), so the connection and the batch go on. An agent
    before this field ignores it (msgspec drops trailing fields it does not know)."""

    names: tuple[str, ...]
    kinds: tuple[int, ...]
    dtypes: tuple[int, ...]
    ndims: tuple[int, ...]
    lengths: bytes
    shapes: bytes
    refused: int = 0


def frame(
    kind: Kind, meta: object = None, *, request_id: int = 0, batch_size: int = 0, payload: int = 0
) -> bytes:
    """Header and meta of a frame of `kind`; `payload` bytes are sent after it by the caller."""
    return encode(
        Header(kind, request_id=request_id, batch_size=batch_size, payload_len=payload), meta
    )


def _padded(n: Any) -> Any:
    """What a value of `n` bytes takes of a REQUEST's payload (ints or an array of them)."""
    return (n + VALUE_ALIGN - 1) // VALUE_ALIGN * VALUE_ALIGN


_PAD = bytes(VALUE_ALIGN)
Signature = tuple[tuple[str, int, int, int], ...]  # per input: name, kind, dtype code, ndim


def _signature(values: Mapping[str, Any]) -> Signature:
    """The inputs of an item as a REQUEST's meta declares them; TypeError or ValueError for
    a value the wire cannot carry (a tensor of an unknown dtype, too many dims, none)."""
    sig = []
    for name, v in values.items():
        if not isinstance(name, str):
            raise TypeError(f"input names are strings, got {name!r}")
        if isinstance(v, str):
            sig.append((name, TEXT, 0, 0))
        elif isinstance(v, np.ndarray):
            try:
                code = DType.of(v.dtype)
            except ValueError as exc:
                raise ValueError(f"input {name!r}: {exc}") from None
            if v.ndim > MAX_NDIM or 0 in v.shape or max(v.shape, default=0) >= 1 << 32:
                raise ValueError(
                    f"input {name!r}: a tensor of shape {v.shape} cannot be sent (at most "
                    f"{MAX_NDIM} dims, each 1 .. 2**32 - 1)"
                )
            sig.append((name, TENSOR, int(code), v.ndim))
        else:
            sig.append((name, BYTES, 0, 0))
    return tuple(sig)


def _data(value: Any) -> bytes | memoryview:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")  # a lone surrogate fails its item
    if isinstance(value, np.ndarray):  # raw bytes in C order, copied only when not already
        a = value if value.flags.c_contiguous else np.ascontiguousarray(value)
        return memoryview(a.reshape(-1).view(np.uint8))
    return value if isinstance(value, (bytes, memoryview)) else memoryview(value).cast("B")


def _nbytes(value: Any) -> int:
    """len(_data(value)), without copying an array that is not contiguous."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, np.ndarray):
        return value.nbytes
    return len(value) if isinstance(value, bytes) else memoryview(value).nbytes


def _request_meta(sig: Signature, lengths: list[int], shapes: list[int], refused: int = 0) -> Any:
    return RequestMeta(
        tuple(s[0] for s in sig),
        tuple(s[1] for s in sig),
        tuple(s[2] for s in sig),
        tuple(s[3] for s in sig),
        np.asarray(lengths, "<u4").tobytes(),
        np.asarray(shapes, "<u4").tobytes(),
        refused,
    )


def _head(first: int, n: int, meta: RequestMeta, total: int) -> bytes:
    blob = encode_meta(meta)
    head = Header(
        Kind.REQUEST, request_id=first, batch_size=n, meta_len=len(blob), payload_len=total
    )
    return head.pack(blob) + blob


def request_frames(
    first_id: int, items: Sequence[Mapping[str, Any]], max_bytes: int
) -> Iterator[tuple[int, bytes, list[Any] | None]]:
    """The REQUEST frames of `items` (request ids first_id, first_id + 1, ...): (items in the
    frame, head, payload parts; None for a refused item's frame, which has none). Values are bytes, str (utf-8 text) or numpy arrays (sent as
    tensors). Consecutive items with the same inputs share a frame, of at most MAX_VALUES
    values, MAX_SHAPE_DIMS dims and `max_bytes` payload bytes. An item larger than that is
    not sent: its frame is a `refused` one (no payload), which the agent fails as too_large.
    Every item is checked before the first frame: TypeError or ValueError, nothing sent."""
    sigs = [_signature(values) for values in items]
    sizes = [sum(_padded(_nbytes(v)) for v in values.values()) for values in items]
    at = 0
    while at < len(items):
        sig = sigs[at]
        if sizes[at] > max_bytes:
            values = items[at]
            shapes = [d for v in values.values() if isinstance(v, np.ndarray) for d in v.shape]
            meta = _request_meta(sig, [0] * len(values), shapes, refused=sizes[at])
            yield 1, _head(first_id + at, 1, meta, 0), None
            at += 1
            continue
        k, dims = max(1, len(sig)), sum(s[3] for s in sig)
        most = max(1, min(MAX_VALUES // k, MAX_SHAPE_DIMS // dims if dims else MAX_VALUES))
        parts: list[Any] = []
        lengths: list[int] = []
        shapes = []
        total, n = 0, 0
        while at + n < len(items) and n < most:
            size = sizes[at + n]
            if n and (sigs[at + n] != sig or total + size > max_bytes):
                break
            values = items[at + n]
            data = [_data(v) for v in values.values()]
            for d in data:
                parts.append(d)
                if len(d) % VALUE_ALIGN:
                    parts.append(_PAD[len(d) % VALUE_ALIGN :])
            lengths += [len(d) for d in data]
            shapes += [dim for v in values.values() if isinstance(v, np.ndarray) for dim in v.shape]
            total, n = total + size, n + 1
        yield n, _head(first_id + at, n, _request_meta(sig, lengths, shapes), total), parts
        at += n


def request_sizes(header: Header, meta: RequestMeta) -> np.ndarray:
    """The (items, inputs) byte lengths of a REQUEST, every one (and every tensor's shape)
    checked against the header before a byte of the payload is read or allocated:
    FrameError if the frame lies (the whole frame is refused, and the connection with it)."""
    k, n = len(meta.names), header.batch_size
    if (
        k > MAX_INPUTS
        or len(set(meta.names)) != k
        or not (len(meta.kinds) == len(meta.dtypes) == len(meta.ndims) == k)
    ):
        raise FrameError(
            f"malformed frame: meta: {k} input names (at most {MAX_INPUTS}, each once) with "
            f"{len(meta.kinds)} kinds, {len(meta.dtypes)} dtypes and {len(meta.ndims)} ndims"
        )
    for name, kind, code, ndim in zip(meta.names, meta.kinds, meta.dtypes, meta.ndims, strict=True):
        tensor = kind == TENSOR and code in _TENSOR_CODES and 0 <= ndim <= MAX_NDIM
        if not (tensor or (kind in (BYTES, TEXT) and code == ndim == 0)):
            raise FrameError(
                f"malformed frame: meta: input {name!r}: kind {kind}, dtype {code}, ndim {ndim} "
                f"(bytes and text: dtype 0, ndim 0; a tensor: a DType code, 0..{MAX_NDIM} dims)"
            )
    dims = sum(meta.ndims)
    if (
        not 1 <= n <= MAX_VALUES // max(k, 1)
        or n * dims > MAX_SHAPE_DIMS
        or len(meta.lengths) != 4 * n * k
        or len(meta.shapes) != 4 * n * dims
    ):
        raise FrameError(
            f"malformed frame: batch_size: {n} items of {k} inputs (at most {MAX_VALUES} "
            f"values, {MAX_SHAPE_DIMS} dims) with {len(meta.lengths)} bytes of lengths (4 per "
            f"value) and {len(meta.shapes)} of shapes (4 per dim, {dims} dims an item)"
        )
    if header.request_id + n - 1 >= 1 << 64:
        raise FrameError(f"malformed frame: request_id: {n} ids from it pass 2**64 - 1")
    sizes = np.frombuffer(meta.lengths, "<u4").astype(np.int64).reshape(n, k)
    if meta.refused:  # one item the client kept: nothing of it is read
        if n != 1 or header.payload_len or sizes.any() or not 0 < meta.refused < 1 << 64:
            raise FrameError(
                f"malformed frame: meta: refused: {meta.refused} bytes not sent, in a frame "
                f"of {n} items, {header.payload_len} payload bytes and lengths {sizes.tolist()}"
                " (a refused item goes alone: no payload, every length 0)"
            )
        return sizes
    if dims:
        _check_shapes(meta, sizes)
    total = int(_padded(sizes).sum())
    if total != header.payload_len:
        raise FrameError(
            f"malformed frame: payload_len: {header.payload_len}, but the lengths (each "
            f"rounded up to {VALUE_ALIGN}) add up to {total}"
        )
    return sizes


def _check_shapes(meta: RequestMeta, sizes: np.ndarray) -> None:
    """Every tensor's length is its shape's bytes; no dim is 0. Vectorized over the items:
    the products are clamped at _ELEMENTS_CAP, so no overflow lets a huge shape pass."""
    n = len(sizes)
    shapes = np.frombuffer(meta.shapes, "<u4").reshape(n, -1)
    col = 0
    for j, (name, kind) in enumerate(zip(meta.names, meta.kinds, strict=True)):
        if kind != TENSOR:
            continue
        dims = shapes[:, col : col + meta.ndims[j]].astype(np.uint64)
        col += meta.ndims[j]
        dtype = DType(meta.dtypes[j]).numpy
        count = np.ones(n, np.uint64)
        for d in dims.T:  # count <= 2**32 and d < 2**32: the product fits uint64
            count = np.minimum(count * d, np.uint64(_ELEMENTS_CAP))
        wrong = (dims == 0).any(axis=1) | (count.astype(np.int64) * dtype.itemsize != sizes[:, j])
        if wrong.any():
            i = int(np.argmax(wrong))
            shape = tuple(int(d) for d in dims[i])
            said = "a dim of 0" if 0 in shape else f"{math.prod(shape) * dtype.itemsize} bytes"
            raise FrameError(
                f"malformed frame: meta: item {i}'s input {name!r}: shape {shape} of {dtype} is "
                f"{said}, but its length is {int(sizes[i, j])}"
            )


def split_request(meta: RequestMeta, sizes: np.ndarray, payload: memoryview) -> list[dict]:
    """The values of each item of a checked REQUEST (`request_sizes`): for bytes, read-only
    views of `payload`; str for text (`_text`); ndarrays of the declared dtype
    and shape for tensors, views of `payload` (no copy; a copy where it is not aligned)."""
    k, n = len(meta.names), len(sizes)
    lengths = sizes.ravel()
    ends = np.cumsum(_padded(lengths))
    starts = (ends - _padded(lengths)).tolist()
    lengths = lengths.tolist()
    # no dims at all when every tensor is a scalar (ndim 0): an empty shape per item
    shapes = np.frombuffer(meta.shapes, "<u4").reshape(n, -1).tolist() if meta.shapes else [[]] * n
    kinds = list(zip(meta.names, meta.kinds, meta.dtypes, meta.ndims, strict=True))
    dtypes = [DType(code).numpy if kind == TENSOR else None for _, kind, code, _ in kinds]
    out = []
    for i in range(n):
        values: dict[str, Any] = {}
        col = 0
        for j, (name, kind, _, ndim) in enumerate(kinds):
            start, size = starts[i * k + j], lengths[i * k + j]
            if kind == TENSOR:
                dtype = dtypes[j]
                a = np.frombuffer(payload, dtype, size // dtype.itemsize, start)  # type: ignore[union-attr]
                a = a.reshape(shapes[i][col : col + ndim])
                values[name] = a if a.flags.aligned else a.copy()
                col += ndim
            elif kind == TEXT:
                values[name] = _text(payload[start : start + size])
            else:
                values[name] = payload[start : start + size].toreadonly()
        out.append(values)
    return out


def _text(data: memoryview) -> str:
    """A text value as the client's str was: a lone surrogate the client sent (surrogatepass)
    comes back as itself, so the stage fails that item as the host does (`bad_text`); bytes that
    are no UTF-8 at all (not from our client) have U+FFFD in their place."""
    try:
        return str(data, "utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return str(data, "utf-8", "replace")
