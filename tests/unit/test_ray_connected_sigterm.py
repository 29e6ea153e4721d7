"""`--ray`: ray.init's own SIGTERM handler (sys.exit(15), left after ray.shutdown) does not
replace the command's: SIGTERM still unwinds it as `Terminated` (exit 143), and serve's drain
handler restores ours, not Ray's, when it ends."""

from __future__ import annotations

import signal
import sys

import pytest

from nicoffload.ray import cluster

ray = pytest.importorskip("ray")


def test_connected_keeps_the_sigterm_handler_it_found(monkeypatch):
    def init(**_):  # as ray.init does
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)

    def ours(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        with cluster.connected("auto"):
            assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)
