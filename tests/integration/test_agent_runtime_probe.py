"""`nicoffload profile` measures the DPU agent's own CPU per item and per batch through a real
agent process (the local topology's emulated DPU): numbers on a machine with a core to spare."""

from __future__ import annotations

import os
import threading

import pytest

from nicoffload.procstat import agent_pids
from nicoffload.profiles import LinkCost
from nicoffload.profiling import measure_agent_runtime

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="one core: no agent beside the host"
)


def test_the_agent_runtime_is_measured_through_a_real_agent(monkeypatch):
    from nicoffload import profiling

    probes = []  # what the real agent measured, for the pricing below
    real = profiling._probe

    def recording(*args, **kwargs):
        probes.append(real(*args, **kwargs))
        return probes[-1]

    monkeypatch.setattr(profiling, "_probe", recording)
    free = LinkCost(0.0, 1e12, 0.0, 0.0)  # transfers priced at nothing: all the agent's CPU
    before = set(agent_pids())  # other tests' agents may be alive, and busy, beside this one
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:  # the probe's own agent is a child of this process while it runs
        while not stop.wait(0.05):
            seen.update(set(agent_pids()) - before)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        got = measure_agent_runtime(free, quick=True)
    finally:
        stop.set()
        watcher.join()
    assert got is not None
    per_item, per_batch = got
    assert per_item > 0
    assert per_batch > 0  # a batch of 4 costs more per item than one of 64
    assert seen, "the probe ran no agent of its own"
    assert not seen & set(agent_pids())  # the agent it started is gone
    # the transfers' price comes off it: priced dear, nothing is left (the same measurements,
    # those of the agent above, priced again: a second agent would measure what this one did)
    assert len(probes) == 2
    replay = iter(probes)
    monkeypatch.setattr(profiling, "_probe", lambda *a, **k: next(replay))
    dear = LinkCost(0.0, 1e12, 1e6, 0.0)
    got = measure_agent_runtime(dear, quick=True)
    assert next(replay, None) is None  # both measurements were priced again
    assert got is not None and got[0] == 0.0
