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
    REQUEST request_id {inputs} + payload: the input values, back to back     (uses one credit)
                                        <-   CREDIT batch_size=n   (n requests forwarded/dropped)
    STATS / DRAIN / HEARTBEAT / SHUTDOWN #call
                                        <-   STATS / ACK / HEARTBEAT / ACK #call | ERROR #call
                                        <-   ERROR request_id=0: fatal, then the agent closes

`#call` is a call id in the header's request_id (>= 1) that the reply echoes. Outputs do not come
back on this connection: the agent forwards them to the receiver named by LOAD's `forward_to`,
proving to it the session's forward key (which both sides derive; it never crosses the wire).
"""

from __future__ import annotations

import msgspec

from nicoffload.transport.frame import Header, Kind, encode, encode_meta

PROTOCOL = "nicoffload-agent/1"
MAX_LOAD_BYTES = 4 << 20  # pipeline YAML + plan JSON
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
MAX_INPUTS = 1024  # inputs of one request (a multi-camera request: 40 images + 40 captions;
# their names and lengths stay well inside MAX_META)
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


class InputMeta(msgspec.Struct, array_like=True, frozen=True):
    name: str
    text: bool  # utf-8 text (a str on the agent) or raw bytes
    length: int


class RequestMeta(msgspec.Struct, array_like=True, frozen=True):
    inputs: tuple[InputMeta, ...]


def frame(
    kind: Kind, meta: object = None, *, request_id: int = 0, batch_size: int = 0, payload: int = 0
) -> bytes:
    """Header and meta of a frame of `kind`; `payload` bytes are sent after it by the caller."""
    return encode(
        Header(kind, request_id=request_id, batch_size=batch_size, payload_len=payload), meta
    )


def request_frame(request_id: int, values: dict[str, bytes | str]) -> tuple[bytes, list[bytes]]:
    """A REQUEST frame head and its payload parts; str values go as utf-8."""
    parts, inputs = [], []
    for name, value in values.items():
        text = isinstance(value, str)
        data = value.encode() if text else bytes(value) if not isinstance(value, bytes) else value
        if not isinstance(name, str):
            raise TypeError(f"input names are strings, got {name!r}")
        inputs.append(InputMeta(name, text, len(data)))
        parts.append(data)
    blob = encode_meta(RequestMeta(tuple(inputs)))
    total = sum(map(len, parts))
    head = Header(Kind.REQUEST, request_id=request_id, meta_len=len(blob), payload_len=total)
    return head.pack(blob) + blob, parts


def split_request(meta: RequestMeta, payload: bytes) -> dict[str, bytes | str]:
    """The values of a REQUEST; ValueError (the item's fault, not the frame's) if they lie."""
    if len(meta.inputs) > MAX_INPUTS:
        raise ValueError(f"{len(meta.inputs)} inputs, at most {MAX_INPUTS}")
    if (
        sum(i.length for i in meta.inputs) != len(payload)
        or min((i.length for i in meta.inputs), default=0) < 0
    ):
        raise ValueError(f"input lengths do not add up to the payload of {len(payload)} bytes")
    values: dict[str, bytes | str] = {}
    at = 0
    for i in meta.inputs:
        if i.name in values:
            raise ValueError(f"input {i.name!r} given twice")
        data = payload[at : at + i.length]
        at += i.length
        values[i.name] = data.decode("utf-8", errors="replace") if i.text else data
    return values
