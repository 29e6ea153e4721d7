"""The link bandwidth a profile measures is sent from a process on the cores an emulated DPU's
agent gets (the local topology's dpu0 share), as that agent's outputs leave it: a big batch is
copied into a shared-memory slot by as many threads as the sender has cores (`copy_flat`), so a
sender on every core measured a rate the pinned agent cannot copy at (on 2 cores: 2 threads
against the agent's 1)."""

from __future__ import annotations

import io
import os
import sys

import pytest

from nicoffload import profiling_links
from nicoffload.topology import local_topology


class _Tx:
    def __init__(self, seen: list) -> None:
        self.seen = seen

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def send(self, tensors, **kw) -> None:
        self.seen.append(sorted(os.sched_getaffinity(0)))

    def flush(self, timeout=None) -> None:
        pass


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity")
def test_the_sending_process_runs_on_the_emulated_dpus_cores(monkeypatch) -> None:
    import nicoffload.transport as transport

    before = os.sched_getaffinity(0)
    seen: list = []
    monkeypatch.setattr(transport, "connect", lambda address, key=None: _Tx(seen))
    monkeypatch.setattr(sys, "argv", ["-c", "shm://x", "16", "2"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("00" * 32 + "\n"))
    try:
        profiling_links._stream_send()
    finally:
        os.sched_setaffinity(0, before)
    dpu = local_topology(gpu=False).device("dpu0") if len(before) > 1 else None
    want = len(before) if dpu is None else dpu.cores
    assert seen and all(len(s) == want for s in seen)
    assert all(set(s) <= before for s in seen)
