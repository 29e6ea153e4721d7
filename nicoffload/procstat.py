"""CPU seconds of processes of this machine, from /proc: a process, the processes it started,
this process's local agents (their worker processes included); the cores this process may run
on."""

from __future__ import annotations

import os
from pathlib import Path


def cores() -> int:
    """The cores this process may run on (its affinity; every core where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process of this machine; 0 when it is gone."""

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The processes `pid`'s threads started (from /proc)."""

    out: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in children.read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def agent_pids() -> list[int]:
    """This process's local agents: its children running dpu_agents.server."""

    out: list[int] = []
    for pid in child_pids(os.getpid()):
        try:
            if b"dpu_agents.server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def agent_cpu_s() -> float:
    """CPU seconds of this process's local agents, their worker processes included."""

    return sum(tree_cpu_s(pid) for pid in agent_pids())


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and of the processes it started that are alive (an agent and
    its worker processes)."""

    return process_cpu_s(pid) + sum(tree_cpu_s(c) for c in child_pids(pid))
