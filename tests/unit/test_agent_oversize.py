"""An item larger than the agent's max_request_bytes (WELCOME) is kept by the client: a frame
without its values tells the agent its size, and the agent fails that item alone as too_large,
in order with the rest of its batch, which runs; the connection goes on."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from dpu_agents.config import AgentConfig
from dpu_agents.server import Agent
from nicoffload.agent.client import AgentClient
from nicoffload.agent.protocol import RequestMeta, request_frames, request_sizes
from nicoffload.errors import FrameError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen
from nicoffload.transport.frame import HEADER_SIZE, Header, Kind, decode_meta, encode_meta

TOKEN = b"0123456789abcdef0123456789abcdef"
LIMIT = 64 << 10
THUMBS = """\
name: thumbs
inputs: {image: {kind: bytes, format: jpeg}}
nodes:
  - {name: decode, op: decode_image, in: image, params: {color: rgb}}
  - {name: resize, op: resize, in: decode, params: {size: [16, 16], antialias: false}}
outputs: {pixels: resize}
batch: {max_size: 8, max_wait_ms: 5}
"""


def parsed(blob: bytes) -> tuple[Header, RequestMeta]:
    header = Header.unpack(blob)
    return header, decode_meta(blob[HEADER_SIZE : HEADER_SIZE + header.meta_len], RequestMeta)


def jpeg(h: int = 32, w: int = 32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.linear_gradient("L").resize((w, h)).convert("RGB").save(buf, "JPEG", quality=50)
    return buf.getvalue()


# --- the frames --------------------------------------------------------------------------


def test_an_item_over_max_bytes_is_a_refused_frame_without_its_values() -> None:
    big = np.zeros((40, 40), np.float32)  # 6400 bytes
    items = [{"t": np.ones((2, 2), np.float32)}, {"t": big}, {"t": np.ones((2, 2), np.float32)}]
    frames = list(request_frames(7, items, max_bytes=1000))
    assert [n for n, _, _ in frames] == [1, 1, 1]
    _, head, parts = frames[1]
    header, meta = parsed(head)
    assert parts is None and header.payload_len == 0 and header.request_id == 8
    assert meta.refused == big.nbytes and np.frombuffer(meta.lengths, "<u4").tolist() == [0]
    assert np.frombuffer(meta.shapes, "<u4").tolist() == [40, 40]
    assert request_sizes(header, meta).tolist() == [[0]]  # it checks: nothing to read
    assert all(parts is not None for _, _, parts in frames[::2])


def test_items_that_fit_share_a_frame_around_a_refused_one() -> None:
    items = [{"a": b"x" * 8}] * 3 + [{"a": b"y" * 200}] + [{"a": b"z" * 8}] * 2
    frames = list(request_frames(1, items, max_bytes=100))
    got = [(parsed(h)[0].request_id, n, parts is None) for n, h, parts in frames]
    assert got == [(1, 3, False), (4, 1, True), (5, 2, False)]


@pytest.mark.parametrize(
    ("payload_len", "lengths", "batch"),
    [(8, [0], 1), (0, [8], 1), (0, [0, 0], 2)],
    ids=["with a payload", "with a length", "with another item"],
)
def test_a_refused_frame_that_carries_anything_is_a_frame_error(payload_len, lengths, batch):
    meta = RequestMeta(("a",), (0,), (0,), (0,), np.asarray(lengths, "<u4").tobytes(), b"", 500)
    header = Header(Kind.REQUEST, request_id=1, batch_size=batch, payload_len=payload_len)
    with pytest.raises(FrameError, match="malformed frame: meta: refused"):
        request_sizes(header, meta)


# --- an agent ----------------------------------------------------------------------------


@pytest.fixture
def agent() -> Iterator[Agent]:
    cfg = AgentConfig(listen="127.0.0.1:0", cores=1, max_request_bytes=LIMIT)
    with Agent(cfg, TOKEN) as a:
        yield a


@pytest.fixture
def loaded(agent: Agent, tmp_path: Path) -> Iterator[tuple[AgentClient, object]]:
    path = tmp_path / "thumbs.yaml"
    path.write_text(THUMBS)
    plan = single_device_plan(load_pipeline(path), "dpu0")
    with (
        listen("tcp://127.0.0.1:0", slots=4, slot_bytes=1 << 20) as rx,
        AgentClient(agent.address, TOKEN, timeout=10) as client,
    ):
        client.load(
            THUMBS, plan, plan.stages[0].name, rx.address, batch_max_size=8, batch_max_wait_ms=5
        )
        yield client, rx


def results(rx, n: int) -> tuple[list[int], dict[int, list[str]]]:
    """The next `n` results: their ids in the order they came, the failed ones' reasons."""
    ids: list[int] = []
    failed: dict[int, list[str]] = {}
    while len(ids) < n:
        d = rx.recv(timeout=30)
        assert d is not None, f"{len(ids)} of {n} results"
        ids += d.meta["request_ids"]
        failed.update({int(k): v for k, v in d.meta["failed"].items()})
        rx.release(d)
    return ids, failed


def test_an_oversize_item_fails_alone_as_too_large_and_the_connection_goes_on(loaded) -> None:
    client, rx = loaded
    assert client.agent.max_request_bytes == LIMIT
    big = b"\xff\xd8\xff" + bytes(LIMIT)
    kept = client.submit_batch(1, [{"image": jpeg()}, {"image": big}, {"image": jpeg()}])
    assert kept == [2]
    ids, failed = results(rx, 3)
    assert ids == [1, 2, 3] and list(failed) == [2]
    reason, detail = failed[2]
    assert reason == "too_large"
    assert f"needs {LIMIT + 8} bytes" in detail and f"max_request_bytes ({LIMIT})" in detail
    assert client.alive
    assert client.submit_batch(4, [{"image": jpeg()}] * 2) == []  # still served
    assert results(rx, 2) == ([4, 5], {})
    assert client.stats()["errors"] == {}  # no frame error: the agent refused nothing


def test_a_refused_claim_that_would_fit_is_a_frame_error(loaded) -> None:
    """The agent does not report too_large for an item that was within the limit."""
    client, _ = loaded
    ((_, head, _),) = request_frames(1, [{"image": bytes(LIMIT + 1)}], LIMIT)
    blob = encode_meta(msgspec.structs.replace(parsed(head)[1], refused=100))
    h = Header(Kind.REQUEST, request_id=1, batch_size=1, meta_len=len(blob))
    client._ch.send(h.pack(blob) + blob)
    client._reader.join(10)
    assert not client.alive and "refused: 100 bytes, within" in str(client.failed)
