"""The end-to-end check of `make test-arm`: a split run whose DPU stage is served by an aarch64
agent (emulated, in the arm64 chroot, listening on loopback) while this native x86 process runs the
host side, over TCP; its outputs must equal the all-host run's bit for bit.

    python tests/arm/split_run.py --root ROOTFS --cpu cortex-a72     (as root, from the repository)

The plan and topology are those of tests/integration/test_split_run.py: decode, resize and crop on
dpu0 (the agent's address), normalize on the host. The pipeline is its resnet50, with batches of
BATCH items, so that a few items (each decoded emulated) still make several batches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tests"))  # the helpers test_split_run imports (agent_kill)

from test_split_run import PIPELINE, split_plan, topology_for  # noqa: E402

import nicoffload  # noqa: E402
from nicoffload.agent import auth  # noqa: E402
from nicoffload.agent.local import LocalAgent  # noqa: E402
from nicoffload.graph import Pipeline, load_pipeline  # noqa: E402
from nicoffload.planner.plan import Plan, single_device_plan  # noqa: E402
from nicoffload.samples import sample_images  # noqa: E402

ITEMS, BATCH = 20, 8  # three batches, the last one short
START_TIMEOUT = 180.0  # importing numpy, numba and the agent under emulation


def agent_prefix(root: Path, cpu: str) -> list[str]:
    """Run LocalAgent's command in the chroot: the chroot's python takes the place of ours."""
    env = [
        f"QEMU_CPU={cpu}",
        "PATH=/opt/venv/bin:/usr/bin:/bin",
        "HOME=/tmp",
        "LANG=C.UTF-8",
        "PYTHONPATH=/src",
        "PYTHONDONTWRITEBYTECODE=1",
        f"NUMBA_CACHE_DIR=/tmp/numba-{cpu}",  # the model's cache the chroot's tests filled
        f"NUMBA_CPU_NAME={cpu}",
    ]
    script = 'cd /src && shift && exec python "$@"'  # $1 is the host's sys.executable
    return ["chroot", str(root), "/usr/bin/env", "-i", *env, "/bin/sh", "-c", script, "sh"]


def with_batches(path: Path) -> Pipeline:
    """PIPELINE with batches of BATCH items, written to `path` (the agent is sent its text)."""
    doc = yaml.safe_load(Path(PIPELINE.path).read_text(encoding="utf-8"))
    doc["batch"]["max_size"] = BATCH
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return load_pipeline(path)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True, help="the arm64 root filesystem")
    ap.add_argument("--cpu", required=True, help="the QEMU_CPU model the agent runs under")
    args = ap.parse_args()
    os.environ["QEMU_CPU"] = args.cpu  # read by qemu-aarch64 at each exec in the chroot

    pipeline = with_batches(args.root / "tmp" / f"split-{args.cpu}.yaml")  # the run's throwaway
    images = [b for _, b in sample_images(ITEMS, seed=7)]
    host = nicoffload.run(
        pipeline, images, plan=Plan.from_json(single_device_plan(pipeline, "cpu").to_json())
    )
    assert host.ok.all(), host.failures

    inner = f"/tmp/agent-{args.cpu}.token"  # the models run at once, each with its own agent
    token = args.root / inner.lstrip("/")
    auth.write_token(token)
    log = args.root / "tmp" / f"agent-{args.cpu}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as err:
        try:
            with LocalAgent(
                inner,
                cores=1,
                prefix=agent_prefix(args.root, args.cpu),
                stderr=err.fileno(),
                start_timeout=START_TIMEOUT,
            ) as agent:
                exe = os.readlink(f"/proc/{agent.pid}/exe")
                assert "qemu" in exe, f"the agent is not emulated: /proc/{agent.pid}/exe -> {exe}"
                started = time.perf_counter() - t0
                result = nicoffload.run(
                    pipeline,
                    images,
                    plan=split_plan(),
                    topology=topology_for(agent),
                    token_file=token,
                )
        except BaseException:
            sys.stderr.write(log.read_text(errors="replace")[-4000:])
            raise
    assert result.stats.failover is None, (
        f"the run failed over to the host: {result.stats.failover}"
    )
    assert result.ok.all(), result.failures
    doc = result.stats.to_json()
    (transfer,) = doc["transfers"].values()
    batches = -(-ITEMS // BATCH)
    assert doc["stages"]["s0-dpu0"]["device"] == "dpu0" and transfer["batches"] >= batches, doc
    want, got = host.outputs["pixels"], result.outputs["pixels"]
    assert same_bits(got, want), (
        f"split run differs from the all-host run: {int((got != want).sum())} elements"
    )
    print(
        f"split run, agent aarch64 ({args.cpu}, {exe}) -> host x86_64 over tcp: "
        f"{ITEMS} items, {transfer['batches']} batches, {got.dtype}{list(got.shape)} bit-exact; "
        f"agent started in {started:.1f} s, run {result.stats.wall_s:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
