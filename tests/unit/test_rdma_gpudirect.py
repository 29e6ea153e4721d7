"""Choosing an rdma receiver's GPU destination: GPUDirect where the platform offers it (dma-buf
first, then nvidia-peermem), pinned host memory otherwise; the choice says why."""

from __future__ import annotations

import dataclasses

import pytest

from nicoffload.transport.gpudirect import DMABUF, PEERMEM, PINNED, GpuCaps, choose, probe

ALL = GpuCaps(gpu=True, rdma_device="mlx5_0", verbs_dmabuf=True, cuda_dmabuf=True, peermem=True)


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
    assert choose(caps).kind == PINNED
