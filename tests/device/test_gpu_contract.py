"""Every GPU kernel meets the shared kernel contract (tests/kernel_contract.py): the reference of
its ops within the stated tolerance, the output's dtype and shape, every element of `out`."""

from __future__ import annotations

import pytest
from kernel_contract import check_kernel

from nicoffload.ops import all_kernels


def gpu_kernels():
    import nicoffload.ops.gpu_image  # noqa: F401  (registers them until OP_MODULES lists it)

    return sorted((k for k in all_kernels() if k.device == "gpu"), key=lambda k: k.ops)


@pytest.mark.parametrize("kernel", gpu_kernels(), ids=lambda k: "+".join(k.ops))
def test_gpu_kernel_meets_the_contract(gpu, kernel):
    assert check_kernel(kernel, seed=11) >= 1


@pytest.mark.parametrize(
    "kernel",
    [k for k in gpu_kernels() if k.ops[0] in ("center_crop", "normalize")],
    ids=lambda k: "+".join(k.ops),
)
def test_gpu_kernel_takes_float_images_where_its_first_op_does(gpu, kernel):
    assert check_kernel(kernel, seed=12, float_input=True) >= 1
