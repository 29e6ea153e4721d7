"""A DPU stage in the middle of a plan: the host decodes, a real agent runs resize + crop +
normalize on the host's decoded tensors, bit-exact with the same nodes run on the host. A
tensor that does not match what the stage reads fails its item; a frame whose shapes lie
closes the connection; a client or agent of another protocol version is refused."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

from dpu_agents.config import AgentConfig
from dpu_agents.server import Agent
from nicoffload.agent.client import AgentClient
from nicoffload.agent.protocol import (
    PROTOCOL,
    TENSOR,
    ChallengeMeta,
    HelloMeta,
    RequestMeta,
    frame,
)
from nicoffload.errors import AgentError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.runtime.stage import Stage
from nicoffload.transport import Delivery, Receiver, listen
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import DType, ErrorMeta, Header, Kind, decode_meta, encode_meta

TOKEN = b"0123456789abcdef0123456789abcdef"
RESNET = Path(__file__).resolve().parents[2] / "pipelines" / "resnet50.yaml"
WAIT_S = 120.0  # a bound against hanging (a LOAD compiles or loads numba kernels), not a measure
PLACEMENT = {"decode": "cpu", "resize": "dpu0", "crop": "dpu0", "norm": "dpu0"}


@pytest.fixture
def agent() -> Iterator[Agent]:
    with Agent(AgentConfig(listen="127.0.0.1:0", cores=2, window=8), TOKEN) as a:
        yield a


@pytest.fixture
def rx() -> Iterator[Receiver]:
    with listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 22) as r:
        yield r


@pytest.fixture(scope="module")
def stages() -> tuple:
    """The plan host -> DPU, the host's decode stage, and the DPU's nodes bound on the host."""
    pipeline = load_pipeline(RESNET)
    plan_stages, transfers = stages_for(pipeline, PLACEMENT)
    plan = Plan(pipeline.name, PLACEMENT, plan_stages, transfers)
    host, dpu = plan.stages
    decode = Stage(pipeline, host, {"decode"})
    same_on_host = Stage(pipeline, dataclasses.replace(dpu, kind="cpu", device="cpu"), {"norm"})
    return plan, dpu.name, decode, same_on_host


def jpeg(seed: int, h: int, w: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 255, (h // 8, w // 8, 3), np.uint8).repeat(8, 0).repeat(8, 1)
    return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=90)


def decoded(decode: Stage, data: bytes) -> dict:
    values = {"image": data}
    decode.process(values, {})
    return values  # the task's values as the host holds them: the JPEG and the decoded image


def load(client: AgentClient, plan: Plan, stage: str, rx: Receiver):
    return client.load(
        RESNET.read_text(), plan, stage, rx.address, batch_max_size=4, batch_max_wait_ms=20
    )


def collect(rx: Receiver, n: int) -> list[Delivery]:
    got, items = [], 0
    while items < n:
        d = rx.recv(timeout=WAIT_S)
        assert d is not None, "no delivery in time"
        got.append(d)
        items += d.batch_size
    return got


def test_a_dpu_stage_fed_the_hosts_decoded_images_is_bit_exact(agent, rx, stages) -> None:
    plan, stage, decode, same_on_host = stages
    tasks = [decoded(decode, jpeg(i, h, w)) for i, (h, w) in enumerate([(300, 400), (480, 320)])]
    tasks += [decoded(decode, jpeg(7, 240, 352))]
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        ack = load(client, plan, stage, rx)
        assert ack.inputs == ("decode",)
        client.submit_batch(1, tasks, timeout=WAIT_S)  # "image" too: only "decode" is sent
        rows = {}
        for d in collect(rx, len(tasks)):
            assert not d.meta.get("failed")
            for row, rid in enumerate(d.meta["request_ids"]):
                rows[rid] = np.array(d.tensors["norm"][row])
            rx.release(d)
    for rid, values in enumerate(tasks, 1):
        want = np.empty((3, 224, 224), np.float16)
        same_on_host.process({"decode": values["decode"]}, {"norm": want})
        assert rows[rid].dtype == np.float16 and rows[rid].shape == (3, 224, 224)
        assert rows[rid].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def test_the_second_dpu_stage_of_dpu_host_dpu_reads_the_hosts_resize(agent, rx) -> None:
    """DPU -> host -> DPU: the last stage reads "resize" (uint8[Hr,Wr,3], its dims dynamic),
    the host's output of the middle stage; every stage but the last is run here, on the host
    (the same kernels the agent binds), and the last also, to compare."""
    placement = {"decode": "dpu0", "resize": "cpu", "crop": "dpu0", "norm": "dpu0"}
    pipeline = load_pipeline(RESNET)
    plan_stages, transfers = stages_for(pipeline, placement)
    plan = Plan(pipeline.name, placement, plan_stages, transfers)
    on_host = [
        Stage(pipeline, dataclasses.replace(s, kind="cpu", device="cpu"), {"resize", "norm"})
        for s in plan.stages
    ]
    tasks = []
    for i, (h, w) in enumerate([(300, 400), (512, 256)]):
        values = {"image": jpeg(10 + i, h, w)}
        for st in on_host[:2]:
            st.process(values, {})
        tasks.append(values)
    assert tasks[1]["resize"].shape == (512, 256, 3)
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        assert load(client, plan, plan.stages[-1].name, rx).inputs == ("resize",)
        client.submit_batch(1, tasks, timeout=WAIT_S)  # with "image" and "decode": not sent
        (d,) = collect(rx, 2)
        assert d.meta["request_ids"] == [1, 2] and not d.meta.get("failed")
        for row, values in enumerate(tasks):
            want = np.empty((3, 224, 224), np.float16)
            on_host[2].process({"resize": values["resize"]}, {"norm": want})
            assert np.array(d.tensors["norm"][row]).tobytes() == want.tobytes()
        rx.release(d)


def test_a_tensor_unlike_the_stages_input_fails_alone(agent, rx, stages) -> None:
    plan, stage, decode, _ = stages
    good = decoded(decode, jpeg(1, 300, 400))
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, plan, stage, rx)
        client.submit(1, {"decode": good["decode"].astype(np.float32)})  # wrong dtype
        client.submit(2, {"decode": good["decode"][:, :, :2].copy()})  # 2 channels, not 3
        client.submit(3, {"decode": good["image"]})  # the JPEG where the image is read
        client.submit(4, good)
        failed, ok = {}, []
        for d in collect(rx, 4):
            failed.update(d.meta.get("failed", {}))
            ok += [r for r in d.meta["request_ids"] if r not in d.meta.get("failed", {})]
            rx.release(d)
        assert sorted(failed) == [1, 2, 3]
        assert {why for why, _ in failed.values()} == {"bad_request"}
        assert ok == [4] and client.alive


def test_a_frame_whose_shape_lies_closes_the_connection(agent, rx, stages) -> None:
    plan, stage, decode, _ = stages
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        load(client, plan, stage, rx)
        # a 300x400x3 image declared, 16 bytes sent: refused before the payload is read
        meta = RequestMeta(
            ("decode",),
            (TENSOR,),
            (int(DType.UINT8),),
            (3,),
            (16).to_bytes(4, "little"),
            np.array([300, 400, 3], "<u4").tobytes(),
        )
        blob = encode_meta(meta)
        head = Header(Kind.REQUEST, request_id=1, batch_size=1, meta_len=len(blob), payload_len=16)
        client._ch.send(head.pack(blob) + blob, [bytes(16)])
        deadline = time.monotonic() + WAIT_S
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "malformed frame: meta: item 0's input 'decode'" in str(client.failed)
    with (  # the agent goes on (a fresh receiver: the closed session's sender may linger)
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 22) as rx2,
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
    ):
        load(client, plan, stage, rx2)
        client.submit(1, decoded(decode, jpeg(2, 64, 64)))
        (d,) = collect(rx2, 1)
        assert not d.meta.get("failed")


def test_a_client_of_another_protocol_is_refused(agent) -> None:
    host, port = agent.address.rsplit(":", 1)
    ch = Channel(socket.create_connection((host, int(port)), timeout=5), "agent", io_timeout=5)
    try:
        ch.send(frame(Kind.HELLO, HelloMeta("old client", "nicoffload-agent/2")))
        assert ch.readable(5.0)
        header, blob = ch.read_head(0)
        assert header.kind is Kind.ERROR
        assert PROTOCOL in decode_meta(blob, ErrorMeta).message
    finally:
        ch.close()


def test_an_agent_of_another_protocol_is_refused_by_the_client() -> None:
    server = socket.create_server(("127.0.0.1", 0))

    def old_agent() -> None:
        conn, _ = server.accept()
        ch = Channel(conn, "client", io_timeout=5)
        ch.read_head(0)
        ch.send(frame(Kind.CHALLENGE, ChallengeMeta(b"n" * 32, "old", "nicoffload-agent/2")))
        ch.readable(5.0)  # until the client hangs up
        ch.close()

    t = threading.Thread(target=old_agent, daemon=True)
    t.start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    with pytest.raises(AgentError, match="speaks 'nicoffload-agent/2'"):
        AgentClient(address, TOKEN, timeout=5)
    t.join(5)
    server.close()
