"""A closed session's batch slots are freed when their budget is given back, not when the
garbage collector next runs: with worker processes, sessions of 75 MB of slots opened and
closed one after another left their shared-memory segments mapped (30 of them held 1 GB of
/dev/shm against a `batch_bytes` of 256 MiB). Loopback, one agent, a few seconds."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from test_agent_budget import MiB, drain, jpeg, loaded, thumbs
from test_agent_hardening import proc_status, served

from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent

SESSIONS = 6
SLOTS_BYTES = 3 * 32 * 512 * 512 * 3  # BATCHES_IN_FLIGHT slots of 32 images of 512x512x3


def held_segments(pid: int) -> int:
    """The agent's descriptors on a session's slot segment (an mmap keeps one)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            n += "nicoffload-slots-" in os.readlink(f"/proc/{pid}/fd/{fd}")
    return n


def test_closed_sessions_give_their_shared_slots_back_at_once(tmp_path: Path) -> None:
    auth.write_token(tmp_path / "token")
    token = auth.read_token(tmp_path / "token")
    config = tmp_path / "agent.toml"
    config.write_text(f"batch_bytes = {128 * MiB}\n")  # room for one such session at a time
    with LocalAgent(tmp_path / "token", cores=2, worker_processes="on", config=config) as a:
        big = thumbs(tmp_path, (512, 512))
        used0 = shutil.disk_usage("/dev/shm").used
        for i in range(SESSIONS):
            with loaded(a, token, big, batch=32, slot_bytes=32 * MiB) as (client, rx):
                client.submit(i, {"image": jpeg(64, 64)})
                assert drain(rx, 1) == {}
            deadline = time.monotonic() + 10  # the agent closes the session once it sees EOF
            while held_segments(a.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held_segments(a.pid) == 0, f"session {i}: its slots are still mapped"
        grew = shutil.disk_usage("/dev/shm").used - used0
        print(f"{SESSIONS} sessions of {SLOTS_BYTES} bytes of slots: /dev/shm +{grew} bytes")
        assert grew < SLOTS_BYTES // 4, grew
        served(a.address, token)  # and the agent serves on
        assert proc_status(a.pid)["fds"] < 40
