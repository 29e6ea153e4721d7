"""Killing a DPU agent process in the middle of a run, for the failover tests."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from typing import Any


def killing_at(agent: Any, items: Iterable[Any], at: int) -> Iterator[Any]:
    """`items`, with the agent killed (SIGKILL) just before item `at` is handed out."""
    for i, item in enumerate(items):
        if i == at:
            os.kill(agent.pid, signal.SIGKILL)
        yield item
