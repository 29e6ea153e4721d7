"""The agent's control protocol: what each frame kind carries between AgentClient and agent.

Every frame is a `transport.frame` frame (64-byte header, msgpack meta, payload). The exchange:

    client                                   agent
    HELLO   {client}                    ->
                                        <-   CHALLENGE {nonce_a, agent}
    AUTH    {nonce_c, proof_c}          ->                    (wrong proof: ERROR, closed, logged)
                                        <-   WELCOME {proof_a, agent, cores, max_request_bytes}
    from here on, both ways, every frame is followed by a 32-byte MAC (auth.session_keys,
    transport.integrity): one that fails is an ERROR and the connection closes (`bad_mac`)
    LOAD    #call {stage, forward_to, ...} + payload: pipeline YAML, plan JSON
                                        <-   ACK #call {session, window, outputs} | ERROR #call
    REQUEST request_id=first batch_size=n {names, text, lengths} + payload: n items' values,
            back to back (ids first .. first+n-1; one credit per frame; lengths checked
            against the header before the payload is read: a lie is a frame error)
                                        <-   CREDIT batch_size=m   (m REQUEST frames done)
    STATS / DRAIN / HEARTBEAT / SHUTDOWN #call
                                        <-   STATS / ACK / HEARTBEAT / ACK #call | ERROR #call
                                        <-   ERROR request_id=0: fatal, then the agent closes

`#call` is a call id in the header's request_id (>= 1) that the reply echoes. Outputs do not come
back on this connection: the agent forwards them to the receiver named by LOAD's `forward_to`,
proving to it the session's forward key (which both sides derive; it never crosses the wire).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from nicoffload.errors import FrameError
from nicoffload.transport.frame import Header, Kind, encode, encode_meta

PROTOCOL = "nicoffload-agent/2"  # 2: a REQUEST carries a batch
MAX_LOAD_BYTES = 4 << 20  # pipeline YAML + plan JSON
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
MAX_INPUTS = 1024  # inputs of one request (a multi-camera request: 40 images + 40 captions;
# their names and lengths stay well inside MAX_META)
MAX_VALUES = 8192  # values (items x inputs) of one REQUEST frame: 32 KiB of lengths
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


class RequestMeta(msgspec.Struct, array_like=True, frozen=True):
    """REQUEST: a batch of items with the same inputs. `lengths` holds one little-endian
    uint32 per item and input, item-major: item i's value of input j is the (i * k + j)-th
    run of bytes of the payload (k = len(names)), so the offsets are their running sum."""

    names: tuple[str, ...]
    text: tuple[bool, ...]  # per input: utf-8 text (a str on the agent) or raw bytes
    lengths: bytes


def frame(
    kind: Kind, meta: object = None, *, request_id: int = 0, batch_size: int = 0, payload: int = 0
) -> bytes:
    """Header and meta of a frame of `kind`; `payload` bytes are sent after it by the caller."""
    return encode(
        Header(kind, request_id=request_id, batch_size=batch_size, payload_len=payload), meta
    )


def _signature(values: Mapping[str, Any]) -> tuple[tuple[str, bool], ...]:
    for name in values:
        if not isinstance(name, str):
            raise TypeError(f"input names are strings, got {name!r}")
    return tuple((name, isinstance(v, str)) for name, v in values.items())


def _data(value: Any) -> bytes | memoryview:
    if isinstance(value, str):
        return value.encode()
    return value if isinstance(value, (bytes, memoryview)) else memoryview(value).cast("B")


def request_frames(
    first_id: int, items: Sequence[Mapping[str, Any]], max_bytes: int
) -> Iterator[tuple[int, bytes, list[Any]]]:
    """The REQUEST frames of `items` (request ids first_id, first_id + 1, ...): (items in the
    frame, head, payload parts). Consecutive items with the same inputs share a frame, of at
    most MAX_VALUES values and `max_bytes` payload bytes (an item larger goes alone)."""
    at = 0
    while at < len(items):
        sig = _signature(items[at])
        k = max(1, len(sig))
        most = max(1, MAX_VALUES // k)
        parts: list[Any] = []
        lengths: list[int] = []
        total, n = 0, 0
        while at + n < len(items) and n < most:
            values = items[at + n]
            if n and _signature(values) != sig:
                break
            data = [_data(v) for v in values.values()]
            size = sum(len(d) for d in data)
            if n and total + size > max_bytes:
                break
            parts += data
            lengths += [len(d) for d in data]
            total, n = total + size, n + 1
        meta = RequestMeta(
            tuple(s[0] for s in sig),
            tuple(s[1] for s in sig),
            np.asarray(lengths, "<u4").tobytes(),
        )
        blob = encode_meta(meta)
        head = Header(
            Kind.REQUEST,
            request_id=first_id + at,
            batch_size=n,
            meta_len=len(blob),
            payload_len=total,
        )
        yield n, head.pack(blob) + blob, parts
        at += n


def request_sizes(header: Header, meta: RequestMeta) -> np.ndarray:
    """The (items, inputs) byte lengths of a REQUEST, every one checked against the header
    before a byte of the payload is read or allocated: FrameError if the frame lies (the
    whole frame is refused, and the connection with it)."""
    k, n = len(meta.names), header.batch_size
    if k > MAX_INPUTS or len(meta.text) != k or len(set(meta.names)) != k:
        raise FrameError(
            f"malformed frame: meta: {k} input names (at most {MAX_INPUTS}, each once) and "
            f"{len(meta.text)} text flags"
        )
    if not 1 <= n <= MAX_VALUES // max(k, 1) or len(meta.lengths) != 4 * n * k:
        raise FrameError(
            f"malformed frame: batch_size: {n} items of {k} inputs (at most {MAX_VALUES} "
            f"values) with {len(meta.lengths)} bytes of lengths (4 per value)"
        )
    if header.request_id + n - 1 >= 1 << 64:
        raise FrameError(f"malformed frame: request_id: {n} ids from it pass 2**64 - 1")
    sizes = np.frombuffer(meta.lengths, "<u4").astype(np.int64).reshape(n, k)
    if int(sizes.sum()) != header.payload_len:
        raise FrameError(
            f"malformed frame: payload_len: {header.payload_len}, but the lengths add up to "
            f"{int(sizes.sum())}"
        )
    return sizes


def split_request(meta: RequestMeta, sizes: np.ndarray, payload: memoryview) -> list[dict]:
    """The values of each item of a checked REQUEST (`request_sizes`): views of `payload`
    (no copy) for bytes, str for text (invalid utf-8 replaced)."""
    ends = np.cumsum(sizes.ravel()).tolist()
    k = len(meta.names)
    out, start = [], 0
    for i in range(len(sizes)):
        values: dict[str, Any] = {}
        for j, name in enumerate(meta.names):
            end = ends[i * k + j]
            data = payload[start:end]
            values[name] = str(data, "utf-8", "replace") if meta.text[j] else data
            start = end
        out.append(values)
    return out
