"""The agent's kernels in worker processes (`worker_processes = "on"`): every placement of the
shipped pipelines gives the all-host run's outputs bit for bit (outputs of varying shape too:
a decode whose image leaves the agent), a worker process killed mid-run fails only the rows it
held and is started again, and nothing is left behind when the agent stops.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from equivalence import assert_same_run, corpus, pinned
from split_plans import agent_topology, run_on_agent

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.local import LocalAgent
from nicoffload.errors import PlanError
from nicoffload.planner import plan_for
from nicoffload.planner.plan import single_device_plan
from nicoffload.procstat import child_pids

SHIPPED = ["pipelines/resnet50.yaml", "pipelines/bert.yaml", "pipelines/clip.yaml"]


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("nicoffload-*")}


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    token = tmp_path_factory.mktemp("agent") / "agent.token"
    auth.write_token(token)
    with LocalAgent(token, cores=2, worker_processes="on") as a:
        a.token_file = token
        yield a


run = run_on_agent


def workers_of(agent) -> list[int]:
    return [
        pid
        for pid in child_pids(agent.pid)
        if b"dpu_agents.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def stats(agent) -> dict:
    with AgentClient(agent.address, auth.read_token(agent.token_file)) as c:
        return c.stats()


def test_the_agent_runs_its_kernels_in_one_process_per_core(agent):
    assert stats(agent)["pool"]["kind"] == "processes"
    assert len(workers_of(agent)) == 2


@pytest.mark.parametrize("path", SHIPPED)
def test_every_placement_equals_the_all_host_run(path, tmp_path, agent):
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 40)
    want = run(pipeline, items, single_device_plan(pipeline, "cpu"), agent)
    assert want.ok.sum() >= 40
    topo = agent_topology(agent)
    names = [n.name for n in pipeline.nodes]
    ran = 0
    for kinds in itertools.product(("cpu", "dpu"), repeat=len(names)):
        if "dpu" not in kinds:
            continue
        pins = dict(zip(names, kinds, strict=True))
        try:
            plan = plan_for(pinned(path, pins, tmp_path, "-".join(kinds)), topo)
        except PlanError:
            continue
        got = run(pipeline, items, plan, agent)
        assert got.stats.failover is None, pins
        assert_same_run(got, want, f"{path} {pins}")
        ran += 1
    assert ran >= 1


def test_a_killed_worker_process_fails_only_its_rows_and_is_started_again(tmp_path, agent):
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 400)
    want = run(pipeline, items, single_device_plan(pipeline, "cpu"), agent)
    names = [n.name for n in pipeline.nodes]
    pins = {n: ("dpu" if i < 3 else "cpu") for i, n in enumerate(names)}
    plan = plan_for(pinned(path, pins, tmp_path, "split"), agent_topology(agent))
    before = stats(agent)["pool"]["restarts"]
    victim = workers_of(agent)[0]

    def kill_soon() -> None:
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)

    t = threading.Thread(target=kill_soon)
    t.start()
    got = run(pipeline, items, plan, agent)
    t.join()
    # what the agent could not compute the host computed: the same outputs, bit for bit
    assert_same_run(got, want, "a worker process killed")
    deadline = time.monotonic() + 30
    while stats(agent)["pool"]["restarts"] == before and time.monotonic() < deadline:
        run(pipeline, items[:8], plan, agent)
    assert stats(agent)["pool"]["restarts"] > before
    assert victim not in workers_of(agent)
    again = run(pipeline, items, plan, agent)
    assert_same_run(again, want, "after the restart")
    assert np.array_equal(again.ok, want.ok)


def test_nothing_is_left_behind_when_the_agent_stops(tmp_path):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    before = segments()
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    with LocalAgent(token, cores=2, worker_processes="on") as a:
        a.token_file = token
        pins = {n.name: "dpu" for n in pipeline.nodes}
        plan = plan_for(pinned(path, pins, tmp_path, "all"), agent_topology(a))
        got = run(pipeline, corpus(pipeline, 20), plan, a)
        assert got.ok.sum() >= 18
        workers = workers_of(a)
        assert len(workers) == 2
    for pid in workers:
        assert (
            not Path(f"/proc/{pid}").exists()
            or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
        )
    assert segments() <= before


def test_a_stopped_worker_process_is_killed_after_worker_timeout_s_and_its_rows_run_on_host(
    tmp_path,
):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    config = tmp_path / "agent.toml"
    config.write_text("worker_timeout_s = 2.0\n")
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 200)
    with LocalAgent(token, cores=2, worker_processes="on", config=config) as a:
        a.token_file = token
        want = run(pipeline, items, single_device_plan(pipeline, "cpu"), a)
        pins = {n.name: "dpu" for n in pipeline.nodes}
        plan = plan_for(pinned(path, pins, tmp_path, "all"), agent_topology(a))
        run(pipeline, items[:8], plan, a)  # the kernels in numba's cache
        victim = workers_of(a)[0]
        os.kill(victim, signal.SIGSTOP)  # before the LOAD: the others build it, and run
        try:
            got = run(pipeline, items, plan, a)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        assert_same_run(got, want, "a worker process stopped")
        assert got.stats.failover is None
        assert stats(a)["pool"]["restarts"] >= 1
        assert victim not in workers_of(a)
        assert_same_run(run(pipeline, items, plan, a), want, "after it was restarted")


def shm_maps(pid: int) -> set[str]:
    """The /dev/shm segments of ours that process `pid` maps."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {
        line.split("/dev/shm/")[1] for line in maps.splitlines() if "/dev/shm/nicoffload-" in line
    }


def gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return b"zombie" in status.read_bytes().lower()
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_for(what, timeout: float = 30.0) -> bool:
    """Poll `what()` until true or `timeout` s (a generous wait, not a threshold)."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def started_agent(tmp_path, config: str = ""):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    path = tmp_path / "agent.toml"
    path.write_text(config)
    a = LocalAgent(token, cores=2, worker_processes="on", config=path)
    a.token_file = token
    return a


def kill_agent_with_stopped_workers(a, workers: list[int]) -> None:
    """SIGSTOP the workers, SIGKILL the agent: no worker may outlive it, nor any of the
    session's shared memory (the segments the workers map)."""
    names = set().union(*(shm_maps(pid) for pid in workers))
    assert any(n.startswith("nicoffload-slots-") for n in names)
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        a.kill()
        assert all(wait_for(lambda pid=pid: gone(pid)) for pid in workers), workers
        assert wait_for(lambda: not any(Path(f"/dev/shm/{n}").exists() for n in names)), names
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_stopped_worker_process_dies_with_the_agent(tmp_path):
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    a = started_agent(tmp_path)
    with a:
        pins = {n.name: "dpu" for n in pipeline.nodes}
        plan = plan_for(pinned(path, pins, tmp_path, "all"), agent_topology(a))
        with nicoffload.open(
            pipeline, plan, agent_topology(a), token_file=a.token_file, workers=2
        ) as session:  # the session is open (loaded) when the agent is killed
            assert session.run(corpus(pipeline, 8)).ok.sum() >= 6
            kill_agent_with_stopped_workers(a, workers_of(a))


def test_a_worker_process_restarted_by_a_load_dies_with_the_agent(tmp_path):
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 8)
    a = started_agent(tmp_path)
    with a:
        pins = {n.name: "dpu" for n in pipeline.nodes}
        plan = plan_for(pinned(path, pins, tmp_path, "all"), agent_topology(a))
        run(pipeline, items, plan, a)
        victim = workers_of(a)[0]
        os.kill(victim, signal.SIGKILL)  # while idle: the next LOAD finds it dead, restarts it
        assert wait_for(lambda: gone(victim))
        with nicoffload.open(
            pipeline, plan, agent_topology(a), token_file=a.token_file, workers=2
        ) as session:
            assert stats(a)["pool"]["restarts"] == 1
            workers = workers_of(a)
            assert len(workers) == 2 and victim not in workers
            time.sleep(0.5)  # the LOAD's threads are gone: the worker lives on (no PDEATHSIG)
            assert session.run(items).ok.sum() >= 6
            assert workers_of(a) == workers
            kill_agent_with_stopped_workers(a, workers)


def noise_jpeg(h: int, w: int, seed: int) -> bytes:
    import simplejpeg

    rng = np.random.default_rng(seed)
    base = np.linspace(0, 200, w, dtype=np.float32)[None, :, None] + rng.normal(0, 20, (h, w, 3))
    return simplejpeg.encode_jpeg(np.clip(base, 0, 255).astype(np.uint8), quality=85)


def arenas_of(agent) -> list[int]:
    """The sizes of the arenas `agent` maps (its workers map the same ones)."""
    sizes = []
    for name in shm_maps(agent.pid):
        if name.startswith(("nicoffload-in-", "nicoffload-out-")):
            with contextlib.suppress(FileNotFoundError):
                sizes.append(Path(f"/dev/shm/{name}").stat().st_size)
    return sizes


def test_large_images_cross_bounded_arenas_counted_in_the_budget(tmp_path):
    """Decoded images leave the agent (a resize that is not antialiased reads the full size):
    1600x1200 ones (5.5 MiB) pass an 8 MiB output arena one or two at a time, 2400x1800 ones
    (12.4 MiB) do not fit one and run on the host; outputs equal the all-host run's."""
    doc = yaml.safe_load(Path("pipelines/resnet50.yaml").read_text())
    doc["nodes"][1]["params"]["antialias"] = False
    doc["inputs"]["image"]["typical"] = {"height": 1200, "width": 1600, "bytes": 2_000_000}
    doc["batch"] = {"max_size": 8, "max_wait_ms": 2}
    pipeline = pinned(doc, {}, tmp_path, "base")
    sizes = [(240, 320)] * 3 + [(1200, 1600)] * 4 + [(1800, 2400)] * 2 + [(240, 320)] * 3
    items = [(f"img{i}", {"image": noise_jpeg(h, w, i)}) for i, (h, w) in enumerate(sizes)]
    most, total, keep = 8 << 20, 24 << 20, 1 << 20
    config = f"max_arena_bytes = {most}\narena_bytes = {total}\narena_keep_bytes = {keep}\n"
    with started_agent(tmp_path, config) as a:
        want = run(pipeline, items, single_device_plan(pipeline, "cpu"), a)
        assert want.ok.all()
        pins = {"decode": "dpu", "resize": "cpu", "crop": "cpu", "norm": "cpu"}
        plan = plan_for(pinned(doc, pins, tmp_path, "split"), agent_topology(a))
        seen: list[list[int]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(arenas_of(a))
                time.sleep(0.005)

        t = threading.Thread(target=watch)
        t.start()
        try:
            got = run(pipeline, items, plan, a)
        finally:
            stop.set()
            t.join()
        assert_same_run(got, want, "large images through the arenas")
        doc_stats = stats(a)
        assert doc_stats["errors"].get("slot_overflow") == 2  # the two over max_arena_bytes
        assert doc_stats["items_ok"] == len(items) - 2
        assert max((max(s, default=0) for s in seen), default=0) <= most
        assert max(sum(s) for s in seen) <= total
        assert all(s <= keep for s in arenas_of(a))  # the outsized ones went after their chunk


RESTARTS = 2


def test_restarting_worker_processes_leaks_no_descriptor_and_no_process(tmp_path):
    """Two workers killed and started again within one open session, the second a restarted
    one (each session's own descriptors left aside): the agent holds as many descriptors as
    before, and no process but its two workers (and the resource tracker)."""
    path = "pipelines/resnet50.yaml"
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 8)
    with started_agent(tmp_path) as a:
        pins = {n.name: "dpu" for n in pipeline.nodes}
        plan = plan_for(pinned(path, pins, tmp_path, "all"), agent_topology(a))
        topo = agent_topology(a)
        with nicoffload.open(pipeline, plan, topo, token_file=a.token_file, workers=2) as session:
            session.run(items)

            def fds() -> int:
                return len(os.listdir(f"/proc/{a.pid}/fd"))

            before = fds()
            first = set(workers_of(a))
            for n in range(1, RESTARTS + 1):  # what a restart leaves shows at once
                now = workers_of(a)  # the first time one of the first workers, then the one
                restarted = [pid for pid in now if pid not in first]  # started in its place
                victim = restarted[0] if restarted else now[0]
                os.kill(victim, signal.SIGKILL)
                assert wait_for(lambda v=victim: gone(v))
                while stats(a)["pool"]["restarts"] < n:  # its rows run on the host meanwhile
                    assert session.run(items).ok.sum() >= 6
            assert stats(a)["pool"]["restarts"] == RESTARTS
            assert len(workers_of(a)) == 2
            assert len(child_pids(a.pid)) <= 3
            assert wait_for(lambda: fds() <= before), (fds(), before)
