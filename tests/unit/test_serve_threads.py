"""serve's threads by name in /proc: each Python thread's name becomes its kernel name, and the
CPU of a process is summed by those names."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from nicoffload.serve.threads import COMM_LEN, cpu_by_thread, name_os_threads

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def test_a_python_threads_name_becomes_its_kernel_name_cut_to_15_bytes():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="nicoffload-a-long-thread-name")
    t.start()
    try:
        assert name_os_threads() >= 2  # this one and the main thread
        comm = Path(f"/proc/self/task/{t.native_id}/comm").read_text().strip()
        assert comm == "nicoffload-a-long-thread-name"[:COMM_LEN]
        assert comm in cpu_by_thread(os.getpid())
    finally:
        stop.set()
        t.join()


def test_cpu_by_thread_counts_a_busy_threads_seconds_under_its_name():
    done = threading.Event()

    def spin() -> None:
        x = 0
        while not done.is_set():
            x += 1

    t = threading.Thread(target=spin, name="spinner-thread")
    t.start()
    try:
        name_os_threads()
        before = cpu_by_thread(os.getpid()).get("spinner-thread", 0.0)
        for _ in range(100):  # up to 10 s for the spinner's first clock tick (busy cores)
            threading.Event().wait(0.1)
            if cpu_by_thread(os.getpid())["spinner-thread"] > before:
                break
        assert cpu_by_thread(os.getpid())["spinner-thread"] > before
    finally:
        done.set()
        t.join()


def test_a_process_that_is_gone_has_no_threads():
    assert cpu_by_thread(2**22 + 12345) == {}
