"""The clock that `serve`'s timestamps and `loadgen`'s share: CLOCK_MONOTONIC, which two
processes read alike when they run on one kernel (the same boot id), so a request's time on the
way to the server and back can be measured from both ends."""

from __future__ import annotations

import time
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def clock_id() -> str:
    """Names this kernel's monotonic clock: equal ids, comparable `now_ns()`; '' if unknown."""
    try:
        return "monotonic:" + _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def now_ns() -> int:
    return time.monotonic_ns()
