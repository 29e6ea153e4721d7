"""A serve process's threads by name, as the kernel sees them: each Python thread's name
written to its /proc comm (Python leaves every thread named after the process), so that
`top -H`, a profiler and `cpu_by_thread` tell the event loop, the batcher and the runtime's
workers apart; and the CPU seconds of each named thread of a process."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

COMM_LEN = 15  # the kernel keeps 15 bytes of a thread's name


def name_os_threads() -> int:
    """Each live Python thread's name as its kernel name (its first 15 bytes); how many were
    named. A thread that ended meanwhile is skipped (its /proc entry is gone)."""
    named = 0
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        try:
            Path(f"/proc/self/task/{t.native_id}/comm").write_bytes(
                t.name.encode("utf-8", "replace")[:COMM_LEN]
            )
            named += 1
        except OSError:  # ended, or no /proc (not Linux)
            pass
    return named


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of `pid`'s live threads, summed by kernel name; {} when the
    process is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    out: Counter[str] = Counter()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            # fields after the command's closing parenthesis: utime and stime are 12th, 13th
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)
