"""A pipeline split between a real agent process (its DPU stage) and the host, the agent
forwarding every batch over rdma:// on real verbs: the outputs equal the all-host run's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import nicoffload
import nicoffload.transport
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import Plan, single_device_plan, stages_for
from nicoffload.topology import Device, Link, Topology

PIPELINE = load_pipeline("pipelines/resnet50.yaml")
SPLIT = {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"}


# Small JPEGs of several shapes and both chroma layouts: what is under test is the split and the
# bytes over verbs, not the decoder (tests/unit has the corpus); the corpus's megapixel images
# cost about 3.5 s each to make and as much again to decode under QEMU's software CPU.
SHAPES = [
    (320, 256, "420"), (256, 344, "444"), (300, 300, "422"),
    (400, 260, "420"), (264, 280, "444"), (352, 288, "420"),
]  # fmt: skip


def images() -> list[bytes]:
    import simplejpeg

    rng = np.random.default_rng(3)
    out = []
    for w, h, sub in SHAPES:
        yy, xx = np.mgrid[:h, :w]
        px = np.stack([xx * 200 // w, yy * 200 // h, (xx + yy) * 200 // (w + h)], axis=-1)
        px += rng.integers(0, 56, px.shape)
        out.append(simplejpeg.encode_jpeg(px.astype(np.uint8), 85, colorsubsampling=sub))
    return out


def host_plan() -> Plan:
    return single_device_plan(PIPELINE, "cpu")


def split_plan() -> Plan:
    stages, transfers = stages_for(PIPELINE, SPLIT)
    return Plan(PIPELINE.name, dict(SPLIT), stages, transfers, topology="rdma-test")


def topology(agent_address: str, transport: str) -> Topology:
    dpu = Device("dpu0", "dpu", 1, 1.0, address=agent_address)
    cpu = Device("cpu", "cpu", 1, 1.0)
    link = Link("dpu0", "cpu", transport, 1e9, 0.0, 0.0)
    return Topology("rdma-test", (cpu, dpu), (link,), "dpu0", "cpu", source="test")


@pytest.fixture
def rdma_front(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Every receiver the runner opens, with the address it asked for."""
    opened: list[tuple[str, object]] = []
    listen = nicoffload.transport.listen

    def recorded(address: str, **kw: int) -> object:
        rx = listen(address, **kw)
        opened.append((address, rx))
        return rx

    monkeypatch.setattr(nicoffload.transport, "listen", recorded)
    return opened


def test_a_split_run_over_rdma_equals_the_all_host_run(tmp_path, rdma_front) -> None:
    from nicoffload.transport.rdma import RdmaReceiver

    items = images()
    token = tmp_path / "agent.token"
    auth.write_token(token)

    def split() -> nicoffload.RunResult:
        with LocalAgent(token, cores=1) as agent:
            return nicoffload.run(
                PIPELINE, items, plan=split_plan(), topology=topology(agent.address, "rdma"),
                token_file=token,
            )  # fmt: skip

    # Under the guest's emulated CPU each process spends ~30 s on numba's first use: the agent
    # starts and loads its stage (on a thread here) while this process makes the reference.
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(split)
        host = nicoffload.run(PIPELINE, items, plan=host_plan())
        result = running.result()
    assert host.ok.all()
    # the runner itself chose rdma:// for the plan's rdma link, on the guest's rxe device
    assert [(a.split("://")[0], type(rx)) for a, rx in rdma_front] == [("rdma", RdmaReceiver)]
    assert result.ok.all() and result.stats.failover is None
    np.testing.assert_array_equal(result.outputs["pixels"], host.outputs["pixels"])
    (transfer,) = result.stats.to_json()["transfers"].values()
    assert transfer["batches"] >= 1
