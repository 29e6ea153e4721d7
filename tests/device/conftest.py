"""tests/device: GPU kernels, staging and the GPU stage.

Tests that need CUDA take the `gpu` fixture, which skips them with the reason where CUDA, torch
or CuPy is missing; the rest (lazy imports, the availability report) run everywhere.
"""

from __future__ import annotations

import pytest

from nicoffload.devices.gpu import availability


@pytest.fixture(scope="session")
def gpu():
    found = availability()
    if not found.ok:
        pytest.skip(f"no usable GPU here: {found.reason}")
    import nicoffload.ops.gpu_decode  # registers the GPU kernels
    import nicoffload.ops.gpu_image  # noqa: F401
    from nicoffload.devices.gpu import device

    return device()
