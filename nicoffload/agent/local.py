"""Start an agent process on this machine and find its address: the emulated DPU of a host
without one (pinned to a core share), and the agent of the integration tests.

    with LocalAgent(token_file, cores=2) as agent:
        client = AgentClient(agent.address, token)
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from nicoffload.errors import AgentError

START_TIMEOUT = 60.0


class LocalAgent:
    """A `nicoffload-agent` child process; `address` once it listens, `stop()` drains it."""

    def __init__(
        self,
        token_file: str | Path,
        *,
        listen: str = "127.0.0.1:0",
        cores: int | None = None,
        worker_processes: str | None = None,
        metrics: str | None = None,
        config: str | Path | None = None,
        prefix: list[str] | None = None,
        stderr: int | None = subprocess.DEVNULL,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        """`prefix` runs the agent under another command (`ip netns exec NS`); `stderr` takes
        its JSON logs (a file descriptor, subprocess.PIPE, or None to inherit)."""
        cmd = [*(prefix or []), sys.executable, "-m", "dpu_agents.server"]
        cmd += ["--listen", listen, "--token-file", str(token_file)]
        if cores:
            cmd += ["--cores", str(cores)]
        if worker_processes:
            cmd += ["--worker-processes", worker_processes]
        if metrics:
            cmd += ["--metrics", metrics]
        if config:
            cmd += ["--config", str(config)]
        # it stops by itself if this process dies without stopping it (server.PARENT_ENV)
        env = {**os.environ, "NICOFFLOAD_AGENT_PARENT": str(os.getpid())}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        try:
            line = self._first_line(start_timeout)
            doc = json.loads(line)
            self.address: str = doc["address"]
            self.metrics_address: str = doc.get("metrics", "")
            self.cores: list[int] = doc.get("cores", [])
        except BaseException:
            self.kill()
            raise

    def _first_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            if ready:  # its stdout closed: it exited before it listened
                try:
                    code = self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    code = None
                raise AgentError(f"the local agent exited (code {code}) before it listened")
            raise AgentError(f"the local agent did not start within {timeout} s")
        return line

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (drain, then exit 0); SIGKILL after `timeout` s. Returns the exit code."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.proc.poll()

    def __enter__(self) -> LocalAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
