"""Every GPU kernel meets the shared kernel contract (tests/kernel_contract.py): the reference of
its ops within the stated tolerance, the output's dtype and shape, every element of `out`."""

from __future__ import annotations

import pytest
from kernel_contract import check_kernel

from nicoffload.ops import all_kernels, get_kernel

# The GPU chains (nicoffload/ops/gpu_image.py), named here so that collecting this file does
# not import that module: registering GPU kernels is the registry's business (OP_MODULES).
CHAINS = (
    ("center_crop",),
    ("center_crop", "normalize"),
    ("decode_image",),
    ("normalize",),
    ("resize",),
    ("resize", "center_crop"),
    ("resize", "center_crop", "normalize"),
)


def test_the_chains_here_are_every_gpu_kernel(gpu):
    assert {k.ops for k in all_kernels() if k.device == "gpu"} == set(CHAINS)


@pytest.mark.parametrize("chain", CHAINS, ids="+".join)
def test_gpu_kernel_meets_the_contract(gpu, chain):
    assert check_kernel(get_kernel(chain, "gpu"), seed=11) >= 1


@pytest.mark.parametrize(
    "chain", [c for c in CHAINS if c[0] in ("center_crop", "normalize")], ids="+".join
)
def test_gpu_kernel_takes_float_images_where_its_first_op_does(gpu, chain):
    assert check_kernel(get_kernel(chain, "gpu"), seed=12, float_input=True) >= 1
