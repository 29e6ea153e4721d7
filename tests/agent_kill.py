"""Killing a DPU agent process in the middle of a run, for the failover tests."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from typing import Any


def killing_at(agent: Any, items: Iterable[Any], at: int) -> Iterator[Any]:
    """`items`, with the agent killed (SIGKILL) just before item `at` is handed out."""
    for i, item in enumerate(items):
        if i == at:
            os.kill(agent.pid, signal.SIGKILL)
        yield item


def run_killing_at(agent: Any, pipeline: Any, items: list[Any], at: int, **run: Any) -> Any:
    """`nicoffload.run` with the agent killed before item `at` (and killed at the end either
    way), checked for what every failover owes: a failover reported, every item once, in
    order, and ok. Returns the run's result for the test's own checks."""
    import nicoffload

    try:
        result = nicoffload.run(pipeline, killing_at(agent, items, at), **run)
    finally:
        agent.kill()
    assert result.stats.failover is not None
    assert result.names == [str(i) for i in range(len(items))]  # each item once, in order
    assert result.ok.all()
    return result


@contextlib.contextmanager
def signal_local_agents_after(delay_s: float, sig: int = signal.SIGKILL) -> Iterator[list[int]]:
    """Every `LocalAgent` started inside gets `sig` `delay_s` after its process starts: while
    it starts, loads its stage, or streams, whichever that moment falls in. Yields the pids."""
    import subprocess

    from nicoffload.agent import local

    pids: list[int] = []
    timers: list[threading.Timer] = []
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        proc = real(*args, **kwargs)
        pids.append(proc.pid)

        def hit() -> None:
            if proc.poll() is None:
                os.kill(proc.pid, sig)

        timers.append(threading.Timer(delay_s, hit))
        timers[-1].start()
        return proc

    local.subprocess.Popen = popen  # type: ignore[attr-defined]
    try:
        yield pids
    finally:
        local.subprocess.Popen = real  # type: ignore[attr-defined]
        for t in timers:
            t.cancel()
