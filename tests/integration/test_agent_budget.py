"""A real agent process under the memory attacks of issue #17 (finding 5), with a small budget
so that a few MB prove the point: many large requests, headers declaring payloads that never
come, a trickling sender, LOADs asking for huge values or batches, many large images, a
pipeline raising max_pixels. Each asserts the agent's resident memory stays within the budget
(plus a margin) and that a well-behaved client is still served."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from test_agent_hardening import proc_status, served, start_agent, token_file  # noqa: F401

from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.local import LocalAgent
from nicoffload.agent.protocol import BYTES, RequestMeta
from nicoffload.errors import AgentError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen
from nicoffload.transport.frame import Header, Kind, encode_meta

MiB = 1 << 20
BUDGET = {
    "max_request_bytes": 16 * MiB,
    "queued_bytes": 16 * MiB,
    "queued_bytes_per_client": 8 * MiB,
    "decode_bytes": 128 * MiB,
    "decode_bytes_per_client": 64 * MiB,
    "batch_bytes": 32 * MiB,
    "max_slot_bytes": 8 * MiB,
    "max_value_bytes": 8 * MiB,
    "payload_timeout_s": 2.0,
}
MARGIN_KB = 40_000  # threads' stacks, allocator slack, the good client's session
THUMBS = """\
name: thumbs
inputs: {image: {kind: bytes, format: jpeg}}
nodes:
  - {name: decode, op: decode_image, in: image, params: {color: rgb%s}}
  - {name: resize, op: resize, in: decode, params: {size: %s, antialias: false}}
outputs: {pixels: resize}
batch: {max_size: 32, max_wait_ms: 20}
"""


def thumbs(tmp_path: Path, size: tuple[int, int] = (32, 32), decode: str = "") -> Path:
    path = tmp_path / f"thumbs-{size[0]}-{len(decode)}.yaml"
    path.write_text(THUMBS % (decode, list(size)))
    return path


@pytest.fixture
def agent(tmp_path: Path, token_file: Path) -> Iterator[LocalAgent]:  # noqa: F811
    config = "".join(f"{k} = {v!r}\n" for k, v in BUDGET.items())
    a = start_agent(tmp_path, token_file, config)
    yield a
    assert a.alive(), "the agent died"
    assert a.stop(timeout=15) == 0


@pytest.fixture
def token(token_file: Path) -> bytes:  # noqa: F811
    return auth.read_token(token_file)


@contextmanager
def loaded(
    agent: LocalAgent,
    token: bytes,
    pipeline: Path,
    slots: int = 2,
    batch: int = 32,
    wait_ms: float = 20,
    slot_bytes: int = 4 * MiB,
) -> Iterator[tuple[AgentClient, object]]:
    """A client with `pipeline` loaded (batches of `batch`, formed within `wait_ms`),
    forwarding to a receiver of `slots` slots."""
    plan = single_device_plan(load_pipeline(pipeline), "dpu0")
    with (
        listen("tcp://127.0.0.1:0", slots=slots, slot_bytes=slot_bytes) as rx,
        AgentClient(agent.address, token, timeout=10) as client,
    ):
        client.load(
            pipeline.read_text(),
            plan,
            plan.stages[0].name,
            rx.address,
            batch_max_size=batch,
            batch_max_wait_ms=20,
        )
        yield client, rx


class Peak(threading.Thread):
    """The agent's largest resident memory (kB) while it runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.kb, self.stop = pid, 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.kb = max(self.kb, proc_status(self.pid)["rss_kb"])
            except (OSError, KeyError):  # the agent has exited (the test failed)
                return
            time.sleep(0.02)

    def finish(self) -> int:
        self.stop.set()
        self.join(5)
        return self.kb


def declare(client: AgentClient, request_id: int, nbytes: int) -> None:
    """Send a REQUEST head declaring `nbytes` of payload, and none of the payload."""
    meta = RequestMeta(("image",), (BYTES,), (0,), (0,), nbytes.to_bytes(4, "little"), b"")
    blob = encode_meta(meta)
    head = Header(
        Kind.REQUEST, request_id=request_id, batch_size=1, meta_len=len(blob), payload_len=nbytes
    )
    client._ch.send(head.pack(blob) + blob)


def dropped_within(client: AgentClient, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while client.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    return not client.alive


def jpeg(h: int, w: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.linear_gradient("L").resize((w, h)).convert("RGB").save(buf, "JPEG", quality=50)
    return buf.getvalue()


def drain(rx, n: int, timeout: float = 30) -> dict:
    """Take `n` results from `rx`: the failed ones' reasons by request id."""
    got, failed = 0, {}
    while got < n:
        d = rx.recv(timeout=timeout)
        assert d is not None, f"{got} of {n} results"
        got += len(d.meta["request_ids"])
        failed.update(d.meta["failed"])
        rx.release(d)
    return failed


def warm(agent: LocalAgent, token: bytes, tmp_path: Path) -> int:
    """Serve both pipelines once (their kernels compiled, the agent warm); its RSS (kB)."""
    served(agent.address, token)
    with loaded(agent, token, thumbs(tmp_path)) as (client, rx):
        client.submit(1, {"image": jpeg(64, 64)})
        assert drain(rx, 1) == {}
    return proc_status(agent.pid)["rss_kb"]


def test_many_large_requests_wait_for_the_budget(agent, token, tmp_path) -> None:
    """60 requests of 4 MiB behind a receiver that holds its slots: the agent stops reading
    the client at its 8 MiB of queued payloads instead of holding all 240 MiB."""
    base = warm(agent, token, tmp_path)
    peak = Peak(agent.pid)
    blob = b"\xff\xd8\xff" + np.random.default_rng(0).bytes(4 * MiB - 3)  # a corrupt JPEG
    with loaded(agent, token, thumbs(tmp_path), slots=1) as (client, rx):
        sent: list[int] = []

        def flood() -> None:
            for i in range(60):
                try:
                    client.submit(i, {"image": blob}, timeout=30)
                except AgentError:
                    return
                sent.append(i)

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        time.sleep(3)
        served(agent.address, token)  # another client is served meanwhile
        held = peak.kb - base
        print(f"many large requests: {held} kB over the base")
        assert held < BUDGET["queued_bytes"] // 1024 + MARGIN_KB, held
        assert len(sent) < 60  # the agent stopped reading: the client's sends wait
        failed = drain(rx, 60)  # the receiver takes its batches: everything goes through
        sender.join(30)
        assert len(sent) == 60 and set(map(int, failed)) == set(range(60))
    peak.finish()


def test_a_request_larger_than_the_budget_fails_and_the_connection_goes_on(agent, token, tmp_path):
    with loaded(agent, token, thumbs(tmp_path)) as (client, rx):
        client.submit(1, {"image": bytes(12 * MiB)})  # > queued_bytes_per_client
        client.submit(2, {"image": jpeg(64, 64)})
        failed = drain(rx, 2)
    assert list(failed) == ["1"] or list(failed) == [1], failed
    reason, detail = next(iter(failed.values()))
    assert reason == "too_large"
    assert f"needs {12 * MiB} bytes, more than the agent's queued budget ({8 * MiB})" in detail


def test_headers_declaring_payloads_that_never_come_hold_no_memory(agent, token, tmp_path) -> None:
    """10 clients each declare a payload (16 MiB: over their budget; 6 MiB: within) and send
    none of it: nothing is allocated up front, and each is dropped after payload_timeout_s."""
    base = warm(agent, token, tmp_path)
    peak = Peak(agent.pid)
    with (
        loaded(agent, token, thumbs(tmp_path)) as a0,
        loaded(agent, token, thumbs(tmp_path)) as a1,
        loaded(agent, token, thumbs(tmp_path)) as a2,
        loaded(agent, token, thumbs(tmp_path)) as a3,
        loaded(agent, token, thumbs(tmp_path)) as a4,
        loaded(agent, token, thumbs(tmp_path)) as a5,
        loaded(agent, token, thumbs(tmp_path)) as a6,
        loaded(agent, token, thumbs(tmp_path)) as a7,
        loaded(agent, token, thumbs(tmp_path)) as a8,
        loaded(agent, token, thumbs(tmp_path)) as a9,
    ):
        attackers = [a[0] for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9)]
        t0 = time.monotonic()
        for i, client in enumerate(attackers):
            declare(client, 1, (16 if i % 2 else 6) * MiB)
        served(agent.address, token)  # while they hold their reservations
        held = peak.kb - base
        print(f"declared payloads: {held} kB over the base")
        assert held < MARGIN_KB, held
        # those over their budget at once; those within it two at a time (16 MiB in all),
        # each payload_timeout_s after its reservation: the others wait unread, holding nothing
        turns = 3 * BUDGET["payload_timeout_s"] + 3
        for client in attackers:
            assert dropped_within(client, turns - (time.monotonic() - t0)), "still connected"
    peak.finish()
    served(agent.address, token)


def test_a_trickling_sender_is_dropped_after_the_payload_timeout(agent, token, tmp_path) -> None:
    """A byte every 0.3 s is never silent for io_timeout_s (30 s); the payload's deadline
    drops it anyway, and its reserved 6 MiB were never allocated."""
    base = warm(agent, token, tmp_path)
    peak = Peak(agent.pid)
    with loaded(agent, token, thumbs(tmp_path)) as (client, _):
        declare(client, 1, 6 * MiB)
        good = threading.Thread(target=served, args=(agent.address, token), daemon=True)
        good.start()  # served while the trickle goes on
        t0 = time.monotonic()
        while client.alive and time.monotonic() - t0 < BUDGET["payload_timeout_s"] + 5:
            try:
                client._ch.sock.send(b"\xff")
            except OSError:
                break
            time.sleep(0.3)
        waited = time.monotonic() - t0
        assert dropped_within(client, 2), f"still connected after {waited:.1f} s"
        good.join(30)
    held = peak.finish() - base
    print(f"trickling sender: dropped after {waited:.1f} s, {held} kB over the base")
    assert waited < BUDGET["payload_timeout_s"] + 3, waited
    assert held < MARGIN_KB, held
    served(agent.address, token)


@pytest.mark.parametrize(
    ("size", "batch", "refusal"),
    [
        (
            (18000, 18000),
            4,
            r"node 'resize': its out value .* more than this agent allows "
            r"\(max_value_bytes = 8388608\)",
        ),
        ((32, 32), 4096, r"batch_max_size 4096 is more than this agent allows \(max_batch"),
        ((1024, 1024), 32, r"is 100663296 bytes, more than this agent allows \(max_slot_bytes"),
    ],
    ids=["huge-resize", "huge-batch", "huge-slot"],
)
def test_a_load_asking_too_much_is_refused_at_once(agent, token, tmp_path, size, batch, refusal):
    base = warm(agent, token, tmp_path)
    pipeline = thumbs(tmp_path, size)
    plan = single_device_plan(load_pipeline(pipeline), "dpu0")
    with (
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=MiB) as rx,
        AgentClient(agent.address, token, timeout=10) as client,
    ):
        t0 = time.monotonic()
        with pytest.raises(AgentError, match=refusal):
            client.load(
                pipeline.read_text(),
                plan,
                plan.stages[0].name,
                rx.address,
                batch_max_size=batch,
                batch_max_wait_ms=20,
            )
        took = time.monotonic() - t0
        client.stats()  # the connection goes on
    grew = proc_status(agent.pid)["rss_kb"] - base
    print(f"LOAD {size} x {batch}: refused in {took:.2f} s, {grew} kB")
    assert took < 2, took
    assert grew < MARGIN_KB, grew
    served(agent.address, token)


def test_many_large_images_are_decoded_within_the_decode_budget(agent, token, tmp_path) -> None:
    """16 JPEGs of 16 megapixels (48 MB decoded each, past what a worker's scratch buffer
    keeps; max_pixels allows 40), sent within one batch's wait: at most the client's 64 MiB of
    decoded images at once, not the batch of them."""
    base = warm(agent, token, tmp_path)
    peak = Peak(agent.pid)
    image = jpeg(4000, 4000)
    with loaded(agent, token, thumbs(tmp_path), wait_ms=200) as (client, rx):
        good = threading.Thread(target=served, args=(agent.address, token), daemon=True)
        good.start()
        submits = threading.Thread(
            target=lambda: [client.submit(i, {"image": image}, timeout=60) for i in range(16)]
        )
        submits.start()  # while the receiver takes the results: the agent reads as memory frees
        got, failed = 0, {}
        while got < 16:
            d = rx.recv(timeout=60)
            assert d is not None
            got += len(d.meta["request_ids"])
            failed.update(d.meta["failed"])
            assert d.tensors["resize"].shape[1:] == (32, 32, 3)
            rx.release(d)
        submits.join(60)
        good.join(60)
    held = peak.finish() - base
    print(f"large images: {held} kB over the base")
    assert failed == {}, failed
    assert held < BUDGET["decode_bytes_per_client"] // 1024 + MARGIN_KB, held


def test_decoded_images_sent_whole_are_held_within_the_decode_budget(agent, token, tmp_path):
    """16 JPEGs of 4 megapixels whose decoded images are the stage's output: each is held
    (12 MB) until its batch is sent, so a batch of them is what the budget must bound."""
    base = warm(agent, token, tmp_path)
    peak = Peak(agent.pid)
    pipeline = tmp_path / "decoded.yaml"
    pipeline.write_text(THUMBS.split("  - {name: resize")[0] % "" + "outputs: {image: decode}\n")
    image = jpeg(2000, 2000)
    with loaded(agent, token, pipeline, wait_ms=200, slot_bytes=256 * MiB) as (client, rx):
        submits = threading.Thread(
            target=lambda: [client.submit(i, {"image": image}, timeout=60) for i in range(16)]
        )
        submits.start()
        failed = drain(rx, 16, timeout=60)
        submits.join(60)
    served(agent.address, token)
    held = peak.finish() - base
    print(f"decoded images sent whole: {held} kB over the base")
    assert failed == {}, failed
    assert held < BUDGET["decode_bytes_per_client"] // 1024 + MARGIN_KB, held


def test_a_pipeline_raising_max_pixels_above_the_operators_bound_is_refused(agent, token, tmp_path):
    base = warm(agent, token, tmp_path)
    greedy = thumbs(tmp_path, decode=", max_pixels: 100000000")
    with (
        pytest.raises(
            AgentError,
            match=r"<pipeline of the LOAD>:4:6: node 'decode': "
            r"max_pixels 100000000 is more than this agent allows "
            r"\(max_pixels = 40000000\)",
        ),
        loaded(agent, token, greedy),
    ):
        pass
    with loaded(agent, token, thumbs(tmp_path, decode=", max_pixels: 1000000")) as (client, rx):
        client.submit(1, {"image": jpeg(64, 64)})
        assert drain(rx, 1) == {}
    served(agent.address, token)
    grew = proc_status(agent.pid)["rss_kb"] - base
    print(f"max_pixels raised: refused, {grew} kB over the base")
    assert grew < MARGIN_KB, grew


def test_loads_past_the_batch_budget_are_refused_until_a_session_closes(agent, token, tmp_path):
    """Each stage's three slots of 10 x 512x512x3 take 23.6 MB of the 32 MiB batch_bytes."""
    big = thumbs(tmp_path, (512, 512))
    with loaded(agent, token, big, batch=10):
        with (
            pytest.raises(AgentError, match=r"batch slots need 23592960 bytes; the agent's "),
            loaded(agent, token, big, batch=10),
        ):
            pass
        served(agent.address, token)  # a small stage still fits
    with loaded(agent, token, big, batch=10) as (client, rx):
        client.submit(1, {"image": jpeg(64, 64)})
        assert drain(rx, 1) == {}
