"""loadgen over gRPC against a real `nicoffload serve --grpc` (host-only plan): the open and
closed loops answer every request, the per-request breakdown (loadgen's parts and the server's,
from the response's parameters) sums to the end-to-end latency as over HTTP, and a refused
call is counted by its gRPC code."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from serve_process import MODEL, TOKEN, Served, host_plan

from nicoffload.samples import sample_images
from nicoffload.serve import loadgen as lg


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loadgen-grpc")
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    plan = host_plan(folder)
    s = Served(
        ["--plan", str(plan), "--token-file", str(token), "--grpc", "127.0.0.1:0"],
        folder / "serve.log",
    )
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def bodies() -> list[bytes]:
    return [lg.grpc_request_body(MODEL, "image", [b]) for _, b in sample_images(3, 5)]


def load(server: Served, bodies: list[bytes], **kw) -> tuple[list[lg.Result], dict]:
    results, wall = asyncio.run(
        lg.run_load(f"grpc://{server.doc['grpc']}", bodies, 1.0, token=kw.pop("token", TOKEN), **kw)
    )
    return results, lg.summarize(results, wall, kw.get("rate"))


def check_breakdown(doc: dict) -> None:
    parts = doc["breakdown_ms"]
    # loadgen's own parts (the way there and back, measured on this kernel's clock) and the
    # server's, from the gRPC response's parameters
    assert {"client_ms", "request_ms", "receive_ms", "host_ms", "encode_ms", "response_ms"} <= set(
        parts
    )
    assert abs(doc["attributed_ratio"] - 1.0) <= 0.01, parts
    assert abs(parts["unattributed_ms"]) <= 0.01 * doc["mean_latency_ms"] + 0.01


def test_closed_loop_over_grpc_answers_all_and_the_parts_sum_to_the_latency(server, bodies):
    results, doc = load(server, bodies, concurrency=2)
    assert doc["sent"] > 0 and doc["ok"] == doc["sent"] and doc["errors_by_status"] == {}
    assert all(r.status == 200 for r in results)
    check_breakdown(doc)


def test_open_loop_over_grpc_answers_all_and_the_parts_sum_to_the_latency(server, bodies):
    results, doc = load(server, bodies, rate=30.0, seed=2)
    assert len(results) == len(lg.arrivals(30.0, 1.0, 2))  # every arrival sent, once
    assert doc["ok"] == doc["sent"] and doc["errors_by_status"] == {}
    check_breakdown(doc)


def test_a_wrong_token_is_counted_as_unauthenticated(server, bodies):
    results, doc = load(server, bodies, concurrency=1, token="not-the-token")
    assert doc["ok"] == 0 and doc["errors_by_status"] == {"UNAUTHENTICATED": len(results)}


def test_an_unknown_model_is_counted_as_not_found(server):
    body = lg.grpc_request_body("no-such-model", "image", [b"x"])
    _, doc = load(server, [body], concurrency=1)
    assert doc["ok"] == 0 and set(doc["errors_by_status"]) == {"NOT_FOUND"}


def test_nothing_listening_is_counted_as_unavailable(tmp_path: Path, bodies):
    import socket

    with socket.socket() as s:  # a port bound and not listening: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        results, _ = asyncio.run(
            lg.run_load(f"grpc://127.0.0.1:{port}", bodies, 0.2, concurrency=1)
        )
    assert results and {r.status for r in results} == {"UNAVAILABLE"}
