"""`nicoffload serve --fronts 2`: two front processes parse and answer, the Session stays in the
serve process. Driven with the Triton HTTP client: the all-host run's tensors, a bad request's
status, deadlines, backpressure, the SIGTERM drain, a front killed with SIGKILL under load;
and `loadgen --procs 2`, whose runs hold every process's requests."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from serve_process import (
    MODEL,
    NICOFFLOAD,
    PIPELINE,
    Served,
    gated_servers,
    host_plan,
    wait_for,
    wait_until,
)
from tritonclient.utils import InferenceServerException

import nicoffload
from nicoffload.samples import sample_images
from nicoffload.serve import eventloop
from nicoffload.serve.loadgen import arrivals

FRONTS = ("--fronts", "2")


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    return host_plan(tmp_path_factory.mktemp("fronts"))


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [b for _, b in sample_images(4, 3)]


@pytest.fixture(scope="module")
def want(plan, images) -> np.ndarray:
    return nicoffload.run(PIPELINE, images, plan=plan).outputs["pixels"]


@pytest.fixture(scope="module")
def server(plan, tmp_path_factory):
    s = Served(
        ["--plan", str(plan), *FRONTS, "--grpc", "127.0.0.1:0"],
        tmp_path_factory.mktemp("log") / "serve.log",
    )
    yield s
    assert s.stop() == 0


def image_input(blobs: list[bytes]) -> httpclient.InferInput:
    i = httpclient.InferInput("image", [len(blobs)], "BYTES")
    i.set_data_from_numpy(np.array(blobs, dtype=object), binary_data=True)
    return i


def children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(x) for x in path.read_text().split()}


def front_stats(log: Path) -> dict:
    line = [x for x in log.read_text().splitlines() if "nicoffload.serve: fronts: " in x][-1]
    return json.loads(line.split("fronts: ", 1)[1])


def test_fronts_answer_the_all_host_tensors_with_their_ids(server, images, want):
    assert server.doc["fronts"] == 2 and len(server.doc["front_pids"]) == 2
    assert server.doc["event_loop"] in ("asyncio", "uvloop")  # the fronts', said
    assert set(server.doc["front_pids"]) <= children(server.proc.pid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # each on its own connection, so both fronts take some
        def one(i: int) -> httpclient.InferResult:
            client = httpclient.InferenceServerClient(server.hostport)
            return client.infer(MODEL, [image_input([images[i % 4]])], request_id=f"r{i}")

        results = list(pool.map(one, range(16)))
    for i, res in enumerate(results):
        assert res.get_response()["id"] == f"r{i}"
        assert res.as_numpy("pixels").tobytes() == want[i % 4 : i % 4 + 1].tobytes()
    res = server.client.infer(MODEL, [image_input(images)])
    assert res.as_numpy("pixels").tobytes() == want.tobytes()
    params = res.get_response()["parameters"]
    parts = sum(v for k, v in params.items() if k.endswith("_us") and k != "server_us")
    assert "forward_us" in params and parts == pytest.approx(params["server_us"], abs=20)


def test_grpc_through_the_fronts_answers_the_same_tensors(server, images, want):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.doc["grpc"])
    i = grpcclient.InferInput("image", [len(images)], "BYTES")
    i.set_data_from_numpy(np.array(images, dtype=object))
    res = client.infer(MODEL, [i], request_id="g1")
    assert res.get_response().id == "g1"
    assert res.as_numpy("pixels").tobytes() == want.tobytes()


def test_a_bad_request_gets_its_status_from_the_front(server, images):
    bad = httpclient.InferInput("image", [1], "INT32")
    bad.set_data_from_numpy(np.array([7], dtype=np.int32))
    with pytest.raises(InferenceServerException) as err:
        server.client.infer(MODEL, [bad])
    assert err.value.status() == "400" and "expected BYTES" in err.value.message()
    with pytest.raises(InferenceServerException) as err:  # the pipeline's verdict comes back
        server.client.infer(MODEL, [image_input([images[0][:200]])])
    assert err.value.status() == "400" and "item 0" in err.value.message()


def test_loadgen_procs_2_merges_every_process_requests(server):
    rate, seconds = 40.0, 1.5
    out = subprocess.run(
        [NICOFFLOAD, "loadgen", server.doc["url"], "--rate", str(rate), "--duration",
         str(seconds), "--sample", "2", "--procs", "2", "--json"],
        capture_output=True, text=True, check=True, cwd=server.log.parent,
    )  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["event_loop"] == "asyncio"  # loadgen's default, said
    run = doc["runs"][0]
    # process i sends the Poisson stream of rate/2 seeded i: both are in the run
    sent = sum(len(arrivals(rate / 2, seconds, i)) for i in range(2))
    assert run["procs"] == 2 and run["sent"] == sent and run["ok"] == sent
    assert run["latency_ms"]["p50"] <= run["latency_ms"]["p99"]


def test_a_front_killed_under_load_is_restarted_and_no_answer_is_wrong(
    plan, images, want, tmp_path
):
    s = Served(["--plan", str(plan), *FRONTS], tmp_path / "serve.log")
    try:
        victim = s.doc["front_pids"][0]

        def one(i: int) -> str:
            try:
                client = httpclient.InferenceServerClient(s.hostport, network_timeout=60)
                res = client.infer(MODEL, [image_input([images[i % 4]])])
            except InferenceServerException as exc:
                return f"status {exc.status()}"
            except Exception:  # the connection closed under it: the killed front's
                return "connection"
            good = res.as_numpy("pixels").tobytes() == want[i % 4 : i % 4 + 1].tobytes()
            return "ok" if good else "wrong tensor"

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(one, i) for i in range(40)]
            wait_until(lambda: sum(j.done() for j in jobs) >= 8, "8 answers")
            os.kill(victim, signal.SIGKILL)
            got = [j.result() for j in jobs]
        assert set(got) <= {"ok", "connection"} and got.count("ok") >= 30
        wait_until(lambda: "front 0 restarted" in s.log.read_text(), "front 0 to restart")
        now = children(s.proc.pid)
        assert victim not in now and len(set(now) - {victim}) >= 2
        after = [one(i) for i in range(6)]  # new connections: to either front, the new one too
        assert after == ["ok"] * 6
    finally:
        assert s.stop() == 0
    stats = front_stats(s.log)
    assert stats["restarts"] == 1 and stats["lost_in_flight"] <= got.count("connection")


def test_the_fronts_run_on_the_loop_asked_for_and_say_so(plan, tmp_path, monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.setenv(eventloop.ENV, "uvloop")  # the fronts inherit serve's environment
    s = Served(["--plan", str(plan), *FRONTS], tmp_path / "serve.log")
    assert s.stop() == 0
    assert front_stats(s.log)["event_loop"] == "uvloop"


@pytest.fixture
def gated(plan, tmp_path):
    with gated_servers(plan, tmp_path, *FRONTS) as start:
        yield start


def test_a_request_past_its_deadline_gets_504(gated, tmp_path, images):
    (tmp_path / "open").touch()
    s = gated()
    with pytest.raises(InferenceServerException) as err:
        s.client.infer(MODEL, [image_input(images[:2])], timeout=1)
    assert err.value.status() == "504" and "2 of 2 items were not run" in err.value.message()
    assert s.client.infer(MODEL, [image_input(images[:1])]).as_numpy("mean").shape == (1,)


def test_past_max_queue_is_503_from_either_front(gated, tmp_path, images):
    s = gated("--max-queue", "2")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(s.client.infer, MODEL, [image_input(images[:2])])
        wait_for(tmp_path / "entered")  # its 2 items are in the model: the queue is full
        for _ in range(4):  # new connections: whichever front takes them, the queue is one
            other = httpclient.InferenceServerClient(s.hostport)
            with pytest.raises(InferenceServerException) as err:
                other.infer(MODEL, [image_input(images[:1])])
            assert err.value.status() == "503" and "--max-queue" in err.value.message()
        (tmp_path / "open").touch()
        assert held.result().as_numpy("mean").shape == (2,)


def test_a_request_in_flight_on_a_killed_front_is_counted_lost(gated, tmp_path, images):
    s = gated()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(s.client.infer, MODEL, [image_input(images[:1])])
        wait_for(tmp_path / "entered")  # in the model, in the Session's process
        for pid in s.doc["front_pids"]:  # whichever front took it
            os.kill(pid, signal.SIGKILL)
        # its connection closed under it: no answer (geventhttpclient's HTTPConnectionClosed)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            held.result()
    (tmp_path / "open").touch()
    wait_until(lambda: s.log.read_text().count("restarted") == 2, "both fronts to restart")
    client = httpclient.InferenceServerClient(s.hostport)
    assert client.infer(MODEL, [image_input(images[:1])]).as_numpy("mean").shape == (1,)
    assert s.stop() == 0
    stats = front_stats(s.log)
    assert stats["restarts"] == 2 and stats["lost_in_flight"] == 1
    assert "with 1 requests in flight: their answers are dropped" in s.log.read_text()


def test_sigterm_drains_every_front_and_exits_0(gated, tmp_path, images):
    s = gated()
    fronts = set(s.doc["front_pids"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(s.client.infer, MODEL, [image_input(images[:3])], "", None, "held")
        wait_for(tmp_path / "entered")
        s.proc.send_signal(signal.SIGTERM)
        # a fresh connection each time: a front with nothing in flight has drained (it answers
        # 503 until every front has, then all exit)
        wait_until(
            lambda: not httpclient.InferenceServerClient(s.hostport).is_server_ready(),
            "readiness to go false",
        )
        other = httpclient.InferenceServerClient(s.hostport)
        with pytest.raises(InferenceServerException) as err:
            other.infer(MODEL, [image_input(images[:1])])
        assert err.value.status() == "503" and "draining" in err.value.message()
        (tmp_path / "open").touch()
        res = held.result()
        assert res.get_response()["id"] == "held" and res.as_numpy("mean").shape == (3,)
    assert s.proc.wait(60) == 0
    assert not any(Path(f"/proc/{p}").exists() for p in fronts)
    assert front_stats(s.log)["lost_in_flight"] == 0
