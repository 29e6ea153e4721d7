"""`nicoffload profile` measures a link's bandwidth from another process, as a stage's outputs
leave an agent for the host (`profiling_links.stream_bandwidth`): between two threads of one process
the same tcp moved 2.1-2.4x as much on the H200 host, and the planner priced decode on the DPU
+102-113% high by it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nicoffload import profiling_links
from nicoffload.profiles import LinkCost, Profile, profile_from_json


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
def test_the_bandwidth_is_measured_from_another_process(scheme, monkeypatch) -> None:
    started: list[list[str]] = []
    real = subprocess.Popen

    def popen(args, *a, **kw):
        started.append(list(args))
        return real(args, *a, **kw)

    monkeypatch.setattr(profiling_links.subprocess, "Popen", popen)
    bandwidth = profiling_links.stream_bandwidth(scheme, 1 << 20, 4)
    assert bandwidth > 0
    assert len(started) == 1 and started[0][0] == sys.executable  # the sender: its own process


def test_a_profile_says_its_bandwidth_came_from_another_process() -> None:
    new = Profile("cpu", {}, links={"tcp": LinkCost(0.1, 1e9, 0.3, 50.0, across=True)})
    old = Profile("cpu", {}, links={"tcp": LinkCost(0.1, 1e9, 0.3, 50.0)})
    assert profile_from_json(new.to_json(), "new").links["tcp"].across
    assert not profile_from_json(old.to_json(), "old").links["tcp"].across
