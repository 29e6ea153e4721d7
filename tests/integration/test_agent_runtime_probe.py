"""`nicoffload profile` measures the DPU agent's own CPU per item through a real agent process
(the local topology's emulated DPU): a number on a machine with a core to spare for it."""

from __future__ import annotations

import os

import pytest

from nicoffload.procstat import agent_cpu_s
from nicoffload.profiles import LinkCost
from nicoffload.profiling import measure_agent_runtime

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="one core: no agent beside the host"
)


def test_the_agent_runtime_is_measured_through_a_real_agent():
    free = LinkCost(0.0, 1e12, 0.0, 0.0)  # transfers priced at nothing: all the agent's CPU
    before = agent_cpu_s()
    us = measure_agent_runtime(free, quick=True)
    assert us is not None and us > 0
    assert agent_cpu_s() == before  # the agent it started is gone, and was a child of this one
    # the transfers' price comes off it: priced dear, nothing is left
    dear = LinkCost(0.0, 1e12, 1e6, 0.0)
    assert measure_agent_runtime(dear, quick=True) == 0.0
