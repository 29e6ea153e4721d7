"""Compile, on this machine, the numba kernels the split test runs in the guest, into the guest's
cache: QEMU's software CPU compiles them in many minutes, this one in seconds. Both sides compile
for NUMBA_CPU_NAME=generic (vm.py sets it, with NUMBA_CACHE_DIR), so the guest loads them."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import test_rdma_split as split

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent


def main() -> None:
    images = split.images()
    nicoffload.run(split.PIPELINE, images, plan=split.host_plan())
    with tempfile.TemporaryDirectory() as folder:
        token = Path(folder) / "agent.token"
        auth.write_token(token)
        with LocalAgent(token, cores=1) as agent:
            topology = split.topology(agent.address, "tcp")
            nicoffload.run(
                split.PIPELINE, images, plan=split.split_plan(), topology=topology, token_file=token
            )


if __name__ == "__main__":
    main()
