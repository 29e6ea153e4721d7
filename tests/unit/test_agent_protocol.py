"""The REQUEST frame: a batch of items back to back with their lengths in the meta; every
length checked against the header before the payload is read, a lying frame refused whole.
(Tensor values: tests/unit/test_agent_tensor_inputs.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from nicoffload.agent.protocol import (
    BYTES,
    MAX_VALUES,
    TEXT,
    RequestMeta,
    request_frames,
    request_sizes,
    split_request,
)
from nicoffload.errors import FrameError
from nicoffload.transport.frame import HEADER_SIZE, Header, Kind, decode_meta

ITEMS = [{"image": b"\xff\xd8" + bytes([i]) * (10 + i), "caption": f"item {i}"} for i in range(5)]


def parsed(blob: bytes) -> tuple[Header, RequestMeta]:
    header = Header.unpack(blob)
    meta = decode_meta(blob[HEADER_SIZE : HEADER_SIZE + header.meta_len], RequestMeta)
    return header, meta


def test_a_batch_goes_in_one_frame_and_comes_back_item_by_item() -> None:
    ((n, head, parts),) = request_frames(41, ITEMS, 1 << 20)
    header, meta = parsed(head)
    assert (n, header.kind, header.request_id, header.batch_size) == (5, Kind.REQUEST, 41, 5)
    payload = memoryview(b"".join(bytes(p) for p in parts))
    values = split_request(meta, request_sizes(header, meta), payload)
    assert [{k: bytes(v) if k == "image" else v for k, v in d.items()} for d in values] == ITEMS


def test_frames_are_cut_at_max_bytes_and_where_the_inputs_change() -> None:
    items = [*ITEMS, {"text": "other inputs"}]
    frames = list(request_frames(1, items, max_bytes=40))
    firsts = [parsed(head)[0].request_id for _, head, _ in frames]
    counts = [n for n, _, _ in frames]
    assert sum(counts) == 6 and counts[-1] == 1 and firsts[-1] == 6
    assert firsts == [1 + sum(counts[:i]) for i in range(len(counts))]
    assert all(parsed(head)[0].payload_len <= 40 or n == 1 for n, head, _ in frames)


def lie(meta: RequestMeta, header: Header, **changes) -> tuple[Header, RequestMeta]:
    fields = {f: getattr(meta, f) for f in meta.__struct_fields__}
    heads = {k: changes.pop(k) for k in ("batch_size", "payload_len") if k in changes}
    m = RequestMeta(**(fields | changes))
    h = Header(
        Kind.REQUEST,
        request_id=header.request_id,
        batch_size=heads.get("batch_size", header.batch_size),
        payload_len=heads.get("payload_len", header.payload_len),
    )
    return h, m


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"payload_len": 1 << 30}, "payload_len"),  # the lengths do not add up to it
        ({"batch_size": 4}, "batch_size"),  # fewer items than the lengths give
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 1 << 31}, "batch_size"),  # past MAX_VALUES
        ({"lengths": b"\x01\x00\x00"}, "batch_size"),  # not 4 bytes a value
        ({"names": ("image", "image")}, "meta"),  # an input twice
        ({"kinds": (TEXT,)}, "meta"),  # a kind short
        ({"kinds": (BYTES, 7)}, "meta"),  # no such kind
        ({"dtypes": (1, 0)}, "meta"),  # a dtype for bytes
    ],
)
def test_a_lying_batch_is_a_frame_error_before_its_payload_is_read(change, field) -> None:
    ((_, head, _),) = request_frames(1, ITEMS, 1 << 20)
    header, meta = lie(*parsed(head)[::-1], **change)
    with pytest.raises(FrameError, match=f"malformed frame: {field}"):
        request_sizes(header, meta)


def test_the_lengths_are_checked_whole_not_wrapped() -> None:
    # two values whose uint32 lengths add up to 2**32 + 2: no wrap-around makes them fit 2 bytes
    meta = RequestMeta(("a",), (BYTES,), (0,), (0,), np.array([2**32 - 1, 3], "<u4").tobytes(), b"")
    header = Header(Kind.REQUEST, request_id=1, batch_size=2, payload_len=2)
    with pytest.raises(FrameError, match="payload_len"):
        request_sizes(header, meta)


def test_a_batch_of_most_values_fits_and_one_more_does_not() -> None:
    ok = RequestMeta(("a",), (BYTES,), (0,), (0,), bytes(4 * MAX_VALUES), b"")
    assert request_sizes(Header(Kind.REQUEST, batch_size=MAX_VALUES), ok).shape == (MAX_VALUES, 1)
    more = RequestMeta(("a",), (BYTES,), (0,), (0,), bytes(4 * (MAX_VALUES + 1)), b"")
    with pytest.raises(FrameError, match="batch_size"):
        request_sizes(Header(Kind.REQUEST, batch_size=MAX_VALUES + 1), more)
