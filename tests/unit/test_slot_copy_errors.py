"""copy_flat when a run fails or no pool can take a run: it returns or raises only once no
pool thread still writes into the slot (the sender then reuses or releases it), and a big
copy made while the interpreter shuts down (a daemon thread's, an atexit handler's) is copied
in the calling thread, as before the copy went parallel."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from nicoffload.transport import slots
from nicoffload.transport.slots import copy_flat


def test_a_failing_run_leaves_no_copy_running(monkeypatch) -> None:
    monkeypatch.setattr(slots, "PARALLEL_COPY_BYTES", 1)
    monkeypatch.setattr(slots, "copy_threads", lambda: 4)
    gate = threading.Event()
    real = slots._copy_run
    calls = []

    def run(pairs):  # the caller's own run (the first) fails at once; the pool's wait a while
        calls.append(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            raise ValueError("the first run fails")
        gate.wait(5)
        real(pairs)

    monkeypatch.setattr(slots, "_copy_run", run)
    src = np.ones(1 << 16, np.uint8)
    dst = np.zeros_like(src)
    threading.Timer(0.3, gate.set).start()
    with pytest.raises(ValueError, match="first run fails"):
        copy_flat([(dst, src)])
    # raised only after the pool's runs ended: their bytes are all there, none lands later
    assert gate.is_set()
    assert dst[len(dst) // 4 :].all()


def test_a_copy_during_interpreter_shutdown_is_made_here() -> None:
    code = """
import atexit, numpy as np
from nicoffload.transport import slots
slots.copy_threads = lambda: 2
def late():
    src = np.ones(8 << 20, np.uint8); dst = np.zeros_like(src)
    slots.copy_flat([(dst, src)])
    print("copied", bool(dst.all()), flush=True)
atexit.register(late)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "copied True" in out.stdout, out.stderr
