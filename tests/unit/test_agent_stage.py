"""A stage loaded on an agent: its outputs are the host executor's, batches carry the request
ids, each id is delivered once, bad items fail alone, backpressure reaches submit, and a dead
agent is noticed."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

import nicoffload
from dpu_agents.config import AgentConfig
from dpu_agents.server import Agent
from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.protocol import AuthMeta, ChallengeMeta, WelcomeMeta, frame
from nicoffload.errors import AgentError, TransportError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan, stages_for
from nicoffload.transport import Delivery, Receiver, listen
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import Kind, decode_meta

TOKEN = b"0123456789abcdef0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]
BERT = ROOT / "pipelines" / "bert.yaml"
RESNET = ROOT / "pipelines" / "resnet50.yaml"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "", "DPUs " * 40]
# How long a test waits for what must come (a batch, a dead client), and the liveness timeout of
# clients in tests that are not about liveness: a bound against hanging, never a measure. A LOAD
# holds the GIL (the tokenizer's parse, numba's compile or cache load) and the agent here runs in
# the test's process, so meanwhile it answers no heartbeat: seconds under emulation (test-arm).
WAIT_S = 120.0


@pytest.fixture
def agent() -> Iterator[Agent]:
    with Agent(AgentConfig(listen="127.0.0.1:0", cores=2, window=8), TOKEN) as a:
        yield a


@pytest.fixture
def rx() -> Iterator[Receiver]:
    with listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 22) as r:
        yield r


def load(client: AgentClient, path: Path, forward_to: str, *, plan=None, stage=None, size=4):
    pipeline = load_pipeline(path)
    plan = plan or single_device_plan(pipeline, "dpu0")
    return client.load(
        path.read_text(),
        plan,
        stage or plan.stages[0].name,
        forward_to,
        batch_max_size=size,
        batch_max_wait_ms=20,
    )


def on_host(path: Path, items: list) -> nicoffload.RunResult:
    """The host executor's outputs: every node on the host CPU (an autodetected topology could
    place some on a local emulated DPU, another agent process)."""
    return nicoffload.run(path, items, plan=single_device_plan(load_pipeline(path), "cpu"))


def collect(rx: Receiver, n: int, timeout: float = WAIT_S) -> list[Delivery]:
    got, items = [], 0
    while items < n:
        d = rx.recv(timeout=timeout)
        assert d is not None
        got.append(d)
        items += d.batch_size
    return got


def jpeg(seed: int, h: int = 300, w: int = 400) -> bytes:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 255, (h // 8, w // 8, 3), np.uint8).repeat(8, 0).repeat(8, 1)
    return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=90)


def test_outputs_match_the_host_run_with_request_ids_per_batch(agent, rx) -> None:
    ref = on_host(BERT, TEXTS)
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        ack = load(client, BERT, rx.address)
        assert {o.key for o in ack.outputs} == {"tok.input_ids", "tok.attention_mask"}
        for i, text in enumerate(TEXTS):
            client.submit(100 + i, {"text": text})
        rows: dict[int, np.ndarray] = {}
        for d in collect(rx, len(TEXTS)):
            assert d.meta["failed"] == {}
            for row, rid in enumerate(d.meta["request_ids"]):
                rows[rid] = d.tensors["tok.input_ids"][row].copy()
            rx.release(d)
    assert sorted(rows) == [100, 101, 102, 103]
    np.testing.assert_array_equal(
        np.stack([rows[100 + i] for i in range(4)]), ref.outputs["input_ids"]
    )


def test_image_stage_is_bit_exact_and_a_corrupt_item_fails_alone(agent, rx) -> None:
    images = [jpeg(1), b"\xff\xd8 not really a jpeg", jpeg(2, 500, 333)]
    ref = on_host(RESNET, images)
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, RESNET, rx.address)
        for i, img in enumerate(images):
            client.submit(i, {"image": img})
        (d,) = collect(rx, 3)
        assert d.meta["request_ids"] == [0, 1, 2]
        assert list(d.meta["failed"]) == [1] and d.meta["failed"][1][0] == ref.failures[0].reason
        np.testing.assert_array_equal(d.tensors["norm"], ref.outputs["pixels"])
        assert not d.tensors["norm"][1].any()
        rx.release(d)


def test_a_repeated_request_id_is_delivered_once(agent, rx) -> None:
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, BERT, rx.address, size=1)
        for rid in (7, 7, 8, 7):
            client.submit(rid, {"text": "once"})
        ids = [rid for d in collect(rx, 2) for rid in d.meta["request_ids"]]
        client.drain(timeout=WAIT_S)
        assert ids == [7, 8]
        assert client.stats()["duplicates"] == 2
        with pytest.raises(TransportError, match="no batch"):
            rx.recv(timeout=0.2)


def test_a_request_with_wrong_inputs_fails_as_an_item(agent, rx) -> None:
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, BERT, rx.address)
        client.submit(1, {"image": b"bytes"})  # an input the stage does not read
        # bytes for a text are read as UTF-8, as the host's tokenizer reads them (5e9445b)
        client.submit(2, {"text": b"bytes, not text"})
        client.submit(3, {"text": "fine"})
        failed = {}
        for d in collect(rx, 3):
            failed.update(d.meta["failed"])
            rx.release(d)
        assert sorted(failed) == [1] and {f[0] for f in failed.values()} == {"bad_request"}
        assert client.alive


def test_a_batch_goes_as_one_frame_runs_as_one_batch_and_returns_one_credit(agent, rx) -> None:
    """Two batches of 3 with room for 8: two deliveries as they were sent (not re-batched into
    one of 6), a corrupt image failing alone, and one credit back per batch (the window counts
    frames: a credit per item would leave the client more credits than the agent allows)."""
    images = [jpeg(1), b"\xff\xd8 not really a jpeg", jpeg(2), jpeg(3), jpeg(4), jpeg(5)]
    ref = on_host(RESNET, images)
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, RESNET, rx.address, size=8)
        client.submit_batch(1, [{"image": img} for img in images[:3]])
        client.submit_batch(4, [{"image": img} for img in images[3:]])
        got = collect(rx, 6)
        assert [d.meta["request_ids"] for d in got] == [[1, 2, 3], [4, 5, 6]]
        assert list(got[0].meta["failed"]) == [2] and not got[1].meta["failed"]
        pixels = np.concatenate([d.tensors["norm"] for d in got])
        np.testing.assert_array_equal(pixels, ref.outputs["pixels"])
        for d in got:
            rx.release(d)
        client.drain(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while client._credits < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # a credit too many would have come by now
        assert client._credits == 8
        assert client.stats()["requests"] == 6


def test_repeated_ids_in_a_batch_are_delivered_once(agent, rx) -> None:
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, BERT, rx.address, size=8)
        client.submit_batch(1, [{"text": t} for t in ("a", "b", "c")])
        client.submit_batch(2, [{"text": t} for t in ("b", "c", "d")])  # 2 and 3 again
        client.submit_batch(2, [{"text": "b"}])  # only repeats: its credit comes back at once
        ids = [rid for d in collect(rx, 4) for rid in d.meta["request_ids"]]
        client.drain(timeout=WAIT_S)
        assert ids == [1, 2, 3, 4]
        assert client.stats()["duplicates"] == 3


def test_a_drain_waits_for_a_request_frame_still_being_read(agent, rx) -> None:
    """A batch frame half read when the agent starts draining is not admitted yet: the drain
    waits for it (it went on at once, the connection closed, and the whole batch failed over)."""
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, BERT, rx.address)
        (conn,) = [c for c in agent.admission.sessions() if c.session is not None]
        conn.session.reading(1)  # as `Ingress._request` does before it reads a payload
        assert not conn.session.drain(0.2)
        conn.session.reading(-1)
        assert conn.session.drain(WAIT_S)


def test_backpressure_blocks_submit_until_the_receiver_releases(agent, rx) -> None:
    """2 slots held by the host, 3 batches in the agent, 8 credits: then submit must wait."""
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, BERT, rx.address, size=1)
        sent = 0
        with pytest.raises(AgentError, match="no credit"):
            for rid in range(40):
                client.submit(rid, {"text": "x"}, timeout=0.5)
                sent += 1
        assert 8 <= sent < 40
        got = 0
        while got < sent:
            d = rx.recv(timeout=WAIT_S)
            got += d.batch_size
            rx.release(d)
        client.submit(1000, {"text": "credit is back"}, timeout=WAIT_S)
        assert rx.recv(timeout=WAIT_S).meta["request_ids"] == [1000]


def test_only_the_planned_dpu_stage_loads(agent, rx) -> None:
    pipeline = load_pipeline(RESNET)
    placement = {"decode": "dpu0", "resize": "dpu0", "crop": "cpu", "norm": "cpu"}
    stages, transfers = stages_for(pipeline, placement)
    plan = nicoffload.Plan(pipeline.name, placement, stages, transfers)
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        with pytest.raises(AgentError, match="not a DPU"):
            load(client, RESNET, rx.address, plan=plan, stage=stages[1].name)
        with pytest.raises(AgentError, match="no stage 'nope'"):
            load(client, RESNET, rx.address, plan=plan, stage="nope")
        with pytest.raises(AgentError, match="cannot load the stage"):
            client.load(
                "name: [broken",
                plan,
                stages[0].name,
                rx.address,
                batch_max_size=4,
                batch_max_wait_ms=1,
            )
        ack = load(client, RESNET, rx.address, plan=plan, stage=stages[0].name)
        # the resize output leaves the stage: one array per item, its shape varies
        assert [(o.key, o.shape) for o in ack.outputs] == [("resize", None)]
        client.submit(5, {"image": jpeg(3, 256, 320)})
        d = rx.recv(timeout=WAIT_S)
        assert d.tensors["resize@0"].shape == (256, 320, 3)


def test_a_dead_agent_fails_submit_and_calls(agent, rx) -> None:
    client = AgentClient(agent.address, TOKEN, timeout=WAIT_S, heartbeat_s=0.1)
    load(client, BERT, rx.address)
    agent.close()  # its connections close: the client sees it at once, without a timeout
    deadline = time.monotonic() + WAIT_S
    while client.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not client.alive
    with pytest.raises(AgentError):
        client.submit(1, {"text": "too late"})
    with pytest.raises(AgentError):
        client.stats()
    client.close()


def test_a_silent_agent_is_declared_dead_by_the_heartbeat() -> None:
    """An agent that authenticates, then stops answering (hung, partitioned): dead in `timeout`."""
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def mute_agent() -> None:
        sock, _ = listener.accept()
        ch = Channel(sock, "client")
        ch.read_head(0)
        nonce = auth.nonce()
        ch.send(frame(Kind.CHALLENGE, ChallengeMeta(nonce, "mute")))
        answer = decode_meta(ch.read_head(0)[1], AuthMeta)
        proof = auth.server_proof(TOKEN, nonce, answer.nonce)
        ch.send(frame(Kind.WELCOME, WelcomeMeta(proof, "mute", 1, 1 << 20)))
        release.wait(10)  # heartbeats pile up unanswered
        ch.close()

    t = threading.Thread(target=mute_agent, daemon=True)
    t.start()
    client = AgentClient(
        f"127.0.0.1:{listener.getsockname()[1]}", TOKEN, timeout=0.5, heartbeat_s=0.1
    )
    t0 = time.monotonic()
    while client.alive and time.monotonic() - t0 < 30:  # a hang bound, not a speed target
        time.sleep(0.02)
    # declared dead by the heartbeat ("no answer"), while the mute agent still holds the line
    assert not client.alive and not release.is_set()
    with pytest.raises(AgentError, match="no answer"):
        client.stats()
    release.set()
    client.close()
    t.join(5)
    listener.close()


def _captions(tmp_path: Path, n: int) -> Path:
    """A pipeline of `n` caption inputs, each tokenized (a multi-caption request)."""
    lines = ["name: captions", "inputs:"]
    lines += [f"  t{i}: {{kind: text}}" for i in range(n)]
    lines += ["nodes:"]
    lines += [
        f"  - {{name: tk{i}, op: tokenize, in: t{i}, params: {{max_length: 8}}}}" for i in range(n)
    ]
    lines += ["outputs:"] + [f"  ids{i}: tk{i}.input_ids" for i in range(n)]
    path = tmp_path / f"captions{n}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_request_of_many_inputs_runs_and_too_many_are_refused_at_load(
    agent, rx, tmp_path
) -> None:
    """80 inputs (40 cameras + 40 captions) were refused item by item ("80 inputs, at most
    64"); now they run, and a pipeline no request could carry is refused once, at LOAD."""
    from nicoffload.agent.protocol import MAX_INPUTS

    many = _captions(tmp_path, 80)
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, many, rx.address)
        values = {f"t{i}": f"caption {i}" for i in range(80)}
        client.submit(1, values, timeout=WAIT_S)
        (d,) = collect(rx, 1)
        assert d.meta["request_ids"] == [1] and not d.meta.get("failed")
        want = on_host(many, [values])
        for i in (0, 79):
            np.testing.assert_array_equal(
                d.tensors[f"tk{i}.input_ids"][0], want.outputs[f"ids{i}"][0]
            )
    too_many = _captions(tmp_path, MAX_INPUTS + 1)
    with (
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
        pytest.raises(AgentError, match=f"at most {MAX_INPUTS}"),
    ):
        load(client, too_many, rx.address)


def test_a_stage_whose_batch_cannot_fit_a_slot_says_what_batch_would() -> None:
    """Before any agent starts: 120 tensors x 64 items once needed 4.9 GiB per slot and failed
    with a bare ValueError from the transport."""
    import dataclasses

    from nicoffload.errors import DeviceError
    from nicoffload.runtime.remote import open_front
    from nicoffload.topology import load_topology

    pipeline = dataclasses.replace(load_pipeline(RESNET), batch_max_size=4096)
    plan = single_device_plan(pipeline, "dpu0")
    device = load_topology(ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml").device(
        "dpu0"
    )
    want = r"GiB per slot.*set `batch: \{max_size: (\d+)\}`"
    with (
        pytest.raises(DeviceError, match=want) as err,
        open_front(pipeline, plan, plan.stages[0], device),
    ):
        pass
    fits = int(re.search(r"max_size: (\d+)", str(err.value))[1])
    assert 0 < fits < 4096
