"""A `nicoffload serve` process for the serving tests (HTTP and gRPC): started, its ready line
read, stopped with SIGTERM; and the host-only plan most of them serve (no agent: each server
starts in about a second)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "resnet50.yaml"
NICOFFLOAD = str(Path(sys.executable).parent / "nicoffload")
MODEL = "resnet50-preprocess"
TOKEN = "s3cret-token"
CPU_ONLY = "name: cpu-only\ningress: cpu\ndevices:\n  cpu: {kind: cpu, cores: 2}\nlinks: []\n"


def host_plan(folder: Path) -> Path:
    """`nicoffload plan` of the pipeline for a host-only topology, saved in `folder`."""
    (folder / "cpu.yaml").write_text(CPU_ONLY)
    out = folder / "plan.json"
    subprocess.run(
        [
            NICOFFLOAD,
            "plan",
            str(PIPELINE),
            "--topology",
            str(folder / "cpu.yaml"),
            "--output",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return out


class Served:
    """A `nicoffload serve` process and the JSON line it printed when ready."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [NICOFFLOAD, "serve", str(PIPELINE), "--listen", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            pytest.fail(f"serve did not become ready: {log.read_text()[-3000:]}")
        self.doc = json.loads(line)
        self.hostport = self.doc["url"].split("//")[1].split("/")[0]
        self.client = httpclient.InferenceServerClient(self.hostport, network_timeout=120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@contextlib.contextmanager
def gated_servers(plan: Path, folder: Path, *common: str) -> Iterator[Callable[..., Served]]:
    """Start servers (`start(*args)`) whose model blocks until the test opens its gate
    (tests/serve_models.py, in `folder`); on the way out the gate opens and they stop."""
    started: list[Served] = []

    def start(*args: str) -> Served:
        s = Served(
            ["--plan", str(plan), "--model", "serve_models:gated", *common, *args],
            folder / "serve.log",
            {"PYTHONPATH": str(ROOT / "tests"), "SERVE_GATE_DIR": str(folder)},
        )
        started.append(s)
        return s

    try:
        yield start
    finally:
        (folder / "open").touch()
        for s in started:
            s.stop()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` every 10 ms for up to a minute; fail the test naming `what`."""
    for _ in range(6000):
        if condition():
            return
        time.sleep(0.01)
    pytest.fail(f"{what}: not within 60 s")


def wait_for(path: Path) -> None:
    wait_until(path.exists, f"{path} to appear")
