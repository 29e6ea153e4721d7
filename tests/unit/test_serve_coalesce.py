"""serve --fronts' groups: the requests a front submits in one turn of its event loop reach the
Session's process as one frame and go into the Batcher in one step, each judged as if alone;
each gets its own answer back. The front's side (`RemoteBatcher`) and the Session's
(`FrontLink`, a Batcher on a real host-only Session) are joined by a socket pair and a pair of
shared-memory segments, as `serve --fronts` joins them across processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import nicoffload
from nicoffload.runner import prepare
from nicoffload.samples import sample_images
from nicoffload.serve import frontwire as wire
from nicoffload.serve.batcher import Batcher, Outcome, Pending, QueueFull
from nicoffload.serve.front import RemoteBatcher, read_frame
from nicoffload.serve.frontlink import FrontLink
from nicoffload.serve.kserve import RequestError
from nicoffload.session import Session
from nicoffload.topology import load_topology
from nicoffload.transport.shm import Segment

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = "name: cpu-only\ningress: cpu\ndevices:\n  cpu: {kind: cpu, cores: 2}\nlinks: []\n"
SLOTS = 8
SLOT_BYTES = wire.slot_bytes_for(3 * 224 * 224 * 2)


@pytest.fixture(scope="module")
def prep(tmp_path_factory):
    folder = tmp_path_factory.mktemp("coalesce")
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text()
    # batches of 2: a group of 4 spans 2 of them, each reusing the runtime's slot
    (folder / "p.yaml").write_text(text.replace("batch: {max_size: 64", "batch: {max_size: 2"))
    (folder / "cpu.yaml").write_text(CPU_ONLY)
    return prepare(folder / "p.yaml", None, load_topology(folder / "cpu.yaml"))


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [b for _, b in sample_images(4, 11)]


@pytest.fixture(scope="module")
def want(prep, images):
    return nicoffload.run(prep.pipeline, images, plan=prep.plan).outputs["pixels"]


def pending(items: list[dict], on_done=lambda o: None) -> Pending:
    now = time.perf_counter()
    return Pending(items, on_done, now, now)


@contextlib.contextmanager
def linked(prep, max_queue: int):
    """A Batcher on a host-only Session, the Session's end of a front (`FrontLink`, read on
    its own thread) and the front's end of the socket; yields (link, front's socket,
    segments)."""
    tag = f"nicoffload-coalesce-test-{os.getpid()}"
    req = Segment(f"{tag}-req", SLOTS * SLOT_BYTES, create=True)
    resp = Segment(f"{tag}-resp", SLOTS * SLOT_BYTES, create=True)
    theirs, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with Session(prep) as session:
            batcher = Batcher(session, None, max_queue)
            link = FrontLink(batcher, mine, req, resp, SLOT_BYTES)
            batcher.after_answers.append(link.flush)
            batcher.start()
            reader = threading.Thread(target=link.serve, daemon=True)
            reader.start()
            segments = {"request": req.name, "response": resp.name}
            yield link, theirs, segments | {"slots": SLOTS, "slot_bytes": SLOT_BYTES}
            theirs.close()  # the front goes: the link's reader ends
            reader.join(30)
            batcher.stop(30)
    finally:
        theirs.close()
        req.close()
        resp.close()


def ask_together(front_sock: socket.socket, segments: dict, max_queue: int, requests: list):
    """A front submitting `requests` (each a list of images) in one turn of its loop, as
    handlers do; each one's (status, pixels' bytes, retry, timings), read from its slot."""

    async def front() -> list[tuple]:
        reader, writer = await asyncio.open_unix_connection(sock=front_sock)
        remote = RemoteBatcher(writer, segments, max_queue)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Outcome]] = [loop.create_future() for _ in requests]
        for blobs, fut in zip(requests, futures, strict=True):
            remote.submit(pending([{"image": b} for b in blobs], fut.set_result))

        async def answers() -> None:
            while True:
                remote.answer(await read_frame(reader))

        reading = asyncio.ensure_future(answers())
        got = []
        for fut in futures:
            o = await fut
            pixels = None if o.outputs is None else o.outputs["pixels"].tobytes()
            if o.release is not None:
                o.release()
            got.append((o.status, pixels, o.retry, o.timings))
        reading.cancel()
        return got

    return asyncio.run(front())


def test_requests_submitted_in_one_turn_arrive_as_one_group_each_answered_its_own(
    prep, images, want
):
    with linked(prep, 64) as (link, theirs, segments):
        got = ask_together(theirs, segments, 64, [[b] for b in images])
    assert link.counts.requests == 4 and link.counts.request_groups == 1
    assert link.counts.inline_requests == 0 and link.counts.inline_responses == 0
    for i, (status, pixels, _, timings) in enumerate(got):
        assert status == 200 and pixels == want[i : i + 1].tobytes()
        parts = sum(v for k, v in timings.items() if k.endswith("_us") and k != "server_us")
        assert "forward_us" in timings and parts == pytest.approx(timings["server_us"], abs=20)


def test_a_group_past_max_queue_runs_what_fits_and_refuses_the_rest_503(prep, images, want):
    with linked(prep, 3) as (link, theirs, segments):
        got = ask_together(theirs, segments, 3, [[b] for b in images])
    assert link.counts.request_groups == 1
    assert [(status, retry) for status, _, retry, _ in got] == [
        (200, False),
        (200, False),
        (200, False),
        (503, True),
    ]
    assert [pixels for _, pixels, _, _ in got[:3]] == [want[i : i + 1].tobytes() for i in range(3)]


def test_a_request_over_more_batches_than_the_runtime_has_slots_comes_back_whole(
    prep, images, want
):
    # 7 items in batches of 2 over 3 slots: its first batch's slot holds its last batch
    long = images + images[:3]
    with linked(prep, 64) as (link, theirs, segments):
        got = ask_together(theirs, segments, 64, [long, images[3:]])
    assert link.counts.request_groups == 1
    assert [(status, pixels) for status, pixels, _, _ in got] == [
        (200, np.concatenate([want, want[:3]]).tobytes()),
        (200, want[3:].tobytes()),
    ]
    assert got[0][3]["batches"] == 4


def test_a_group_is_admitted_in_order_each_request_as_if_alone(prep, images):
    item = {"image": images[0]}
    with Session(prep) as session:
        batcher = Batcher(session, None, max_queue=3)  # not started: what it admits stays
        refused = batcher.submit_many(
            [pending([item] * 2), pending([item] * 2), pending([item]), pending([item] * 4)]
        )
        assert refused[0] is None and refused[2] is None
        assert isinstance(refused[1], QueueFull) and "--max-queue" in str(refused[1])
        assert isinstance(refused[3], RequestError) and refused[3].status == 413
        assert batcher.outstanding == 3
