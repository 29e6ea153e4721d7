"""Choosing an rdma receiver's GPU destination: GPUDirect where the platform offers it (dma-buf
first, then nvidia-peermem), pinned host memory otherwise; the choice says why."""

from __future__ import annotations

import dataclasses

import pytest

from nicoffload.transport import gpudirect
from nicoffload.transport.gpudirect import DMABUF, PEERMEM, PINNED, GpuCaps, probe

ALL = GpuCaps(gpu=True, rdma_device="mlx5_0", verbs_dmabuf=True, cuda_dmabuf=True, peermem=True)
EVERY_KIND = frozenset({DMABUF, PEERMEM, PINNED})


def choose(caps: GpuCaps):
    """The ranking, as if this version could land into every kind."""
    return gpudirect.choose(caps, EVERY_KIND)


def test_this_version_lands_through_peermem_and_passes_over_dma_buf_saying_so() -> None:
    dest = gpudirect.choose(ALL)
    assert dest.kind == PEERMEM and dest.gpudirect  # dma-buf is not built: the next best
    only_dmabuf = dataclasses.replace(ALL, peermem=False)
    dest = gpudirect.choose(only_dmabuf)
    assert dest.kind == PINNED and not dest.gpudirect
    assert "gpudirect-dmabuf is available, but this version does not register" in dest.reason


def test_dma_buf_is_preferred_when_both_paths_exist() -> None:
    dest = choose(ALL)
    assert dest.kind == DMABUF and dest.gpudirect
    assert "mlx5_0" in dest.describe()


def test_nvidia_peermem_is_used_when_dma_buf_is_not_offered() -> None:
    assert choose(dataclasses.replace(ALL, cuda_dmabuf=False)).kind == PEERMEM
    assert choose(dataclasses.replace(ALL, verbs_dmabuf=False)).kind == PEERMEM


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"gpu": False}, "no CUDA device"),
        ({"rdma_device": None}, "no RDMA device"),
        ({"cuda_dmabuf": False, "peermem": False}, "dma-buf export in the CUDA driver missing"),
        ({"verbs_dmabuf": False, "peermem": False}, "ibv_reg_dmabuf_mr"),
    ],
)
def test_without_gpudirect_the_ring_is_pinned_host_memory_and_says_why(
    change: dict, why: str
) -> None:
    dest = choose(dataclasses.replace(ALL, **change))
    assert dest.kind == PINNED and not dest.gpudirect
    assert why in dest.reason


def test_probing_a_machine_never_raises() -> None:
    caps = probe(None)
    assert caps.rdma_device is None
    assert gpudirect.choose(caps).kind == PINNED


def test_plan_reports_the_destination_of_each_rdma_transfer_into_a_gpu(tmp_path) -> None:
    """Camera photos of 3 MP: the example server's DPU decodes them at 1/2 in the DCT domain
    (the resize to 256 still shrinks 3x after it), a quarter of the pixels the GPU's nvJPEG
    would decode, and sends the decoded image straight into the GPU."""
    import re
    from pathlib import Path

    from nicoffload.graph import load_pipeline
    from nicoffload.planner import plan_for
    from nicoffload.transport.gpudirect import for_plan

    text = Path("pipelines/resnet50.yaml").read_text()
    photo = "typical: {height: 1536, width: 2048, bytes: 800000}"
    (tmp_path / "photos.yaml").write_text(re.sub(r"typical: \{[^}]*\}", photo, text))
    topo = "pipelines/topologies/bluefield3-h100.yaml"
    plan = plan_for(load_pipeline(tmp_path / "photos.yaml"), topo, None, "throughput")
    into_gpu = [
        t
        for t in plan.transfers
        if t.transport.startswith("rdma")
        and next(s for s in plan.stages if s.name == t.dst_stage).kind == "gpu"
    ]
    assert into_gpu  # the example server sends from the DPU straight into the GPU
    assert {(t.tensor, t.bytes_per_item) for t in into_gpu} == {("decode", 768 * 1024 * 3)}
    rows = for_plan(plan, dataclasses.replace(ALL, cuda_dmabuf=False, peermem=False))
    assert [r["transfer"] for r in rows] == [f"{t.src_stage} -> {t.dst_stage}" for t in into_gpu]
    assert {r["destination"] for r in rows} == {PINNED}
    assert all("dma-buf export in the CUDA driver missing" in r["reason"] for r in rows)
    gpudirect_links = [r for r in rows if r["link"] == "rdma-gpudirect"]
    assert gpudirect_links and all("pinned host memory" in r["warning"] for r in gpudirect_links)
    # with nvidia-peermem the ring is registered GPU memory: no warning on a gpudirect link
    rows = for_plan(plan, ALL)
    assert {r["destination"] for r in rows} == {PEERMEM}
    assert not any("warning" in r for r in rows)


@pytest.mark.parametrize("link", ["tcp", "shm"])
def test_plan_reports_a_transfer_from_the_dpu_into_the_gpu_as_a_pinned_landing(tmp_path, link):
    from pathlib import Path

    from nicoffload.graph import load_pipeline
    from nicoffload.planner import plan_for
    from nicoffload.topology import local_topology
    from nicoffload.transport.gpudirect import for_plan

    text = Path("pipelines/resnet50.yaml").read_text()
    path = tmp_path / "split.yaml"
    path.write_text(text + "placement: {decode: [dpu], resize: [dpu], crop: [dpu], norm: [gpu]}\n")
    plan = plan_for(load_pipeline(path), local_topology(gpu=True, dpu_link=link), runnable=True)
    (row,) = for_plan(plan, ALL)  # only a transfer from a DPU stage into a GPU stage lands
    assert (row["transfer"], row["tensor"], row["destination"]) == (
        "s0-dpu0 -> s1-gpu0",
        "crop",
        PINNED,
    )
    assert row["reason"].startswith(f"a {link} receiver's ring is host memory")
    # the host feeding the GPU is the executor's pinned staging, not a landing: not listed
    path.write_text(text + "placement: {decode: [cpu], resize: [cpu], crop: [cpu], norm: [gpu]}\n")
    assert for_plan(plan_for(load_pipeline(path), local_topology(gpu=True)), ALL) == []
