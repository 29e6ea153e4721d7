"""Every registered kernel, of every op and device, fused or not, meets the kernel contract."""

from __future__ import annotations

import pytest
from kernel_contract import check_kernel

from nicoffload.ops import Kernel, all_kernels


def _present(device: str) -> str | None:
    """None when kernels of `device` can run here, else why not."""
    if device in ("cpu", "dpu"):  # the DPU agent runs the same numba code as the host
        return None
    from nicoffload.devices.gpu import availability

    found = availability()
    return None if found.ok else found.reason


KERNELS = sorted(all_kernels(), key=lambda k: ("+".join(k.ops), k.device))


@pytest.fixture(params=KERNELS, ids=lambda k: f"{'+'.join(k.ops)}@{k.device}")
def kernel(request) -> Kernel:
    why = _present(request.param.device)
    if why:
        pytest.skip(f"no {request.param.device} here: {why}")
    return request.param


def test_kernel_matches_reference_and_writes_all_of_out(kernel):
    assert check_kernel(kernel, seed=1) >= 1


def test_kernel_accepts_float_images_where_its_first_op_does(kernel):
    if kernel.ops[0] not in ("center_crop", "normalize"):
        pytest.skip(f"{kernel.ops[0]} takes no float image")
    assert check_kernel(kernel, seed=2, float_input=True) >= 1
