"""Integration tests start real agents as children of the test process: each module must leave
none running (a leaked agent costs the rest of the run its core, and its CPU shows up in the
measurements of later tests)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time

import pytest

from nicoffload.procstat import agent_pids


@pytest.fixture(scope="session", autouse=True)
def _each_sample_image_made_once():
    """A sample image is a pure function of its index and seed, and making one (tiles of
    photographs, noise, a JPEG encode) takes 10-20 ms: the modules ask for the same ones over
    and over (the equivalence corpus, seed 3: about 900 asked for, 400 distinct), so each is
    made once in this process. Agents and CLI runs, in processes of their own, make theirs."""
    from nicoffload import samples

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(samples, "sample_image", functools.lru_cache(1024)(samples.sample_image))
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_agent_outlives_its_module():
    before = set(agent_pids())
    yield
    deadline = time.monotonic() + 10  # an agent stopped at the end may take a moment to exit
    while (left := set(agent_pids()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # not to burden later modules
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"this module left local agents running: {sorted(left)}"
