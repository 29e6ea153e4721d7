"""What holds on every machine: no CUDA library at import, and an availability report."""

from __future__ import annotations

import subprocess
import sys

from nicoffload.devices.gpu import availability


def test_importing_the_gpu_modules_imports_neither_torch_nor_cupy():
    code = (
        "import sys\n"
        "import nicoffload, nicoffload.ops.gpu_image, nicoffload.ops.gpu_decode, nicoffload.devices.gpu\n"
        "import nicoffload.runtime.gpu_stage\n"
        "from nicoffload import ops\n"
        "assert ('decode_image',) in {k.ops for k in ops.all_kernels() if k.device == 'gpu'}\n"
        "print(sorted(m for m in ('torch', 'cupy', 'torchvision') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_availability_always_says_why():
    found = availability()
    assert found.reason
    if not found.ok:
        assert any(w in found.reason for w in ("torch", "CUDA", "cupy", "device"))
