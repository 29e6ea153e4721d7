"""The slots and frames between `serve --fronts` processes: what goes in comes out, what does
not fit says so (and then travels inline)."""

from __future__ import annotations

import socket

import numpy as np

from nicoffload.serve import frontwire as wire


def test_items_come_back_out_of_their_slot_bytes_and_text():
    slot = np.zeros(1 << 12, np.uint8)
    items = [{"image": b"\xff\xd8jpeg", "text": "héllo"}, {"image": b"", "text": ""}]
    layout = wire.put_items(slot, items)
    assert layout is not None and wire.get_items(slot, layout) == items


def test_items_larger_than_the_slot_do_not_go_in():
    assert wire.put_items(np.zeros(8, np.uint8), [{"image": b"123456789"}]) is None


def test_outputs_come_back_as_views_of_their_slot():
    slot = np.zeros(1 << 16, np.uint8)
    outs = {"pixels": np.arange(2 * 3 * 5, dtype=np.float16).reshape(2, 3, 5),
            "label": np.array([3, 1], np.int64)}  # fmt: skip
    layout = wire.put_outputs(slot, outs)
    assert layout is not None
    got = wire.get_outputs(slot, layout)
    for k, v in outs.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v)
        assert np.shares_memory(got[k], slot)


def test_outputs_of_objects_or_too_large_do_not_go_in():
    assert wire.put_outputs(np.zeros(64, np.uint8), {"x": np.zeros(100, np.uint8)}) is None
    assert wire.put_outputs(np.zeros(64, np.uint8), {"x": np.array([b"a"], object)}) is None


def test_slots_fit_two_items_outputs_in_64_kib_pages():
    assert wire.slot_bytes_for(301_056) == 640 << 10
    assert wire.slot_bytes_for(10) == 256 << 10


def test_frames_round_trip_and_the_end_is_none():
    a, b = socket.socketpair()
    with a, b:
        group = [(1, None, False, [{"image": b"x" * 100_000}], 1.0, 2.0, None)]
        wire.send(a, ("reqs", group))
        assert wire.recv(b)[1][0][3][0]["image"] == b"x" * 100_000
        a.close()
        assert wire.recv(b) is None
