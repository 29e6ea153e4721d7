"""On a topology that emulates a DPU on this machine's cores, a session whose plan starts no
agent still keeps the host's threads to the host's share of the cores: the share the planner
prices the host at, and the one the host has beside a running agent (which takes the first)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import nicoffload
from nicoffload.planner import plan_placement
from nicoffload.topology import local_topology

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two cores: no emulated DPU on one",
)


def _jpeg() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), 90, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_an_all_host_session_keeps_to_the_hosts_share_and_gives_the_cores_back() -> None:
    pipeline = nicoffload.load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    topo = local_topology(gpu=False)
    dpu = topo.device("dpu0")
    plan = plan_placement(pipeline, {n.name: "cpu" for n in pipeline.nodes}, topo)
    before = os.sched_getaffinity(0)
    with nicoffload.open(pipeline, plan, topo) as session:
        inside = os.sched_getaffinity(0)
        assert inside == set(sorted(before)[dpu.cores :])
        assert len(inside) == topo.device("cpu").cores
        assert session.run([_jpeg()] * 3).ok.all()
    assert os.sched_getaffinity(0) == before


def test_a_topology_without_an_emulated_dpu_leaves_the_cores_alone() -> None:
    pipeline = nicoffload.load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    topo = local_topology(gpu=False, emulate_dpu=False)
    plan = plan_placement(pipeline, {n.name: "cpu" for n in pipeline.nodes}, topo)
    before = os.sched_getaffinity(0)
    with nicoffload.open(pipeline, plan, topo):
        assert os.sched_getaffinity(0) == before
