"""The memory budget of issue #17 (finding 5) with the kernels in worker processes: decoded
images live in the workers and in the shared arenas, so the agent's own RSS says little; here
the proportional set size (PSS) of the whole tree, agent and workers, is what must stay within
the budget, while a well-behaved client is served. Loopback, one agent, small budget."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_agent_budget import (
    BUDGET,
    MARGIN_KB,
    THUMBS,
    MiB,
    declare,
    drain,
    dropped_within,
    jpeg,
    loaded,
    thumbs,
    warm,
)
from test_agent_hardening import served

from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.procstat import child_pids

ARENAS = {"arena_bytes": 64 * MiB, "max_arena_bytes": 32 * MiB, "arena_keep_bytes": 8 * MiB}


def tree_pss_kb(pid: int) -> int:
    """PSS (kB) of the agent and its worker processes: shared pages counted once in all."""
    total = 0
    for p in [pid, *child_pids(pid)]:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except OSError:  # a worker restarting
            continue
        total += next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
    return total


class TreePeak(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.kb, self.stop = pid, 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.is_set():
            self.kb = max(self.kb, tree_pss_kb(self.pid))
            time.sleep(0.02)

    def finish(self) -> int:
        self.stop.set()
        self.join(5)
        return self.kb


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    tmp = tmp_path_factory.mktemp("agent")
    auth.write_token(tmp / "token")
    config = tmp / "agent.toml"
    config.write_text("".join(f"{k} = {v!r}\n" for k, v in {**BUDGET, **ARENAS}.items()))
    with LocalAgent(tmp / "token", cores=2, worker_processes="on", config=config) as a:
        a.token = auth.read_token(tmp / "token")
        assert len(child_pids(a.pid)) >= 2  # the workers (and the resource tracker)
        yield a
        assert a.alive(), "the agent died"


def test_decoded_images_sent_whole_stay_within_the_budget_across_worker_processes(agent, tmp_path):
    """24 JPEGs of 4 megapixels whose decoded images (12 MB each, 288 MB in all) are the
    stage's output, sent within one batch's wait: they cross the workers' output arenas, so
    the tree holds at most the client's decode budget and the arenas, not the batch."""
    warm(agent, agent.token, tmp_path)
    pipeline = tmp_path / "decoded.yaml"
    pipeline.write_text(THUMBS.split("  - {name: resize")[0] % "" + "outputs: {image: decode}\n")
    base = tree_pss_kb(agent.pid)
    peak = TreePeak(agent.pid)
    image = jpeg(2000, 2000)
    with loaded(agent, agent.token, pipeline, wait_ms=200, slot_bytes=400 * MiB) as (client, rx):
        good = threading.Thread(target=served, args=(agent.address, agent.token), daemon=True)
        good.start()
        submits = threading.Thread(
            target=lambda: [client.submit(i, {"image": image}, timeout=60) for i in range(24)]
        )
        submits.start()
        failed = drain(rx, 24, timeout=60)
        submits.join(60)
        good.join(60)
    held = peak.finish() - base
    print(f"decoded images, worker processes: {held} kB of PSS over the base")
    assert failed == {}, failed
    bound = (BUDGET["decode_bytes_per_client"] + ARENAS["arena_bytes"]) // 1024 + MARGIN_KB
    assert held < bound, (held, bound)
    served(agent.address, agent.token)


def test_a_trickling_sender_is_dropped_and_holds_nothing_with_worker_processes(agent, tmp_path):
    warm(agent, agent.token, tmp_path)
    base = tree_pss_kb(agent.pid)
    peak = TreePeak(agent.pid)
    with loaded(agent, agent.token, thumbs(tmp_path)) as (client, _):
        declare(client, 1, 6 * MiB)
        good = threading.Thread(target=served, args=(agent.address, agent.token), daemon=True)
        good.start()
        t0 = time.monotonic()
        while client.alive and time.monotonic() - t0 < BUDGET["payload_timeout_s"] + 5:
            try:
                client._ch.sock.send(b"\xff")
            except OSError:
                break
            time.sleep(0.3)
        waited = time.monotonic() - t0
        assert dropped_within(client, 2), f"still connected after {waited:.1f} s"
        good.join(30)
    held = peak.finish() - base
    print(f"trickling sender, worker processes: dropped after {waited:.1f} s, {held} kB")
    assert waited < BUDGET["payload_timeout_s"] + 3, waited
    assert held < MARGIN_KB, held
    served(agent.address, agent.token)
