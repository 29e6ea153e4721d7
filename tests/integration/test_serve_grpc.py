"""`nicoffload serve --grpc` as a real process, driven with the official Triton gRPC client
(tritonclient.grpc): the tensors of `nicoffload.run`, each bad request's gRPC code and reason,
the token as `authorization` metadata, deadlines, backpressure and the drain. Host-only plans."""

from __future__ import annotations

import concurrent.futures
import signal
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from serve_process import (
    MODEL,
    PIPELINE,
    TOKEN,
    Served,
    gated_servers,
    host_plan,
    wait_for,
    wait_until,
)
from tritonclient.utils import InferenceServerException

import nicoffload
from nicoffload.samples import sample_images

AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    return host_plan(tmp_path_factory.mktemp("grpc"))


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [b for _, b in sample_images(5, 3)]


@pytest.fixture(scope="module")
def server(plan, tmp_path_factory):
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text(TOKEN + "\n")
    args = ["--plan", str(plan), "--token-file", str(token), "--max-request-mb", "4"]
    s = Served([*args, "--grpc", "127.0.0.1:0"], tmp_path_factory.mktemp("log") / "serve.log")
    yield s
    assert s.stop() == 0


def client(s: Served) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(s.doc["grpc"])


def image_input(blobs: list[bytes]) -> grpcclient.InferInput:
    i = grpcclient.InferInput("image", [len(blobs)], "BYTES")
    i.set_data_from_numpy(np.array(blobs, dtype=object))
    return i


def refused(c, inputs, model: str = MODEL, **kw) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        c.infer(model, inputs, headers=kw.pop("headers", AUTH), **kw)
    return err.value


def test_ready_line_names_the_grpc_address(server):
    host, port = server.doc["grpc"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert server.doc["url"].endswith(f"/v2/models/{MODEL}/infer")  # HTTP beside it


def test_outputs_equal_nicoffload_run_bit_for_bit(server, plan, images):
    want = nicoffload.run(PIPELINE, images, plan=plan).outputs["pixels"]
    res = client(server).infer(MODEL, [image_input(images)], request_id="g-1", headers=AUTH)
    got = res.as_numpy("pixels")
    assert got.dtype == np.float16 and got.shape == (5, 3, 224, 224)
    assert got.tobytes() == want.tobytes()
    resp = res.get_response()
    assert resp.id == "g-1" and resp.model_name == MODEL
    # the batcher's breakdown: consecutive parts that sum to server_us (until it answered)
    from nicoffload.serve.loadgen import PARTS

    t = {k: v.int64_param for k, v in resp.parameters.items()}
    parts = [k for k in PARTS if k in t]
    assert {"receive_us", "queue_us", "host_us", "answer_us"} <= set(parts)
    assert abs(sum(t[k] for k in parts) - t["server_us"]) <= len(parts)


def test_a_named_output_is_the_one_returned(server, plan, images):
    want = nicoffload.run(PIPELINE, images[:1], plan=plan).outputs["pixels"]
    out = grpcclient.InferRequestedOutput("pixels")
    res = client(server).infer(MODEL, [image_input(images[:1])], outputs=[out], headers=AUTH)
    assert res.as_numpy("pixels").tobytes() == want.tobytes()


def test_an_unknown_output_is_invalid_argument(server, images):
    out = grpcclient.InferRequestedOutput("logits")
    err = refused(client(server), [image_input(images[:1])], outputs=[out])
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "unknown output 'logits'" in (
        err.message()
    )


def test_health_is_open_and_metadata_needs_the_token(server):
    c = client(server)
    assert c.is_server_live() and c.is_server_ready()
    with pytest.raises(InferenceServerException) as err:
        c.get_model_metadata(MODEL)
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    meta = c.get_model_metadata(MODEL, headers=AUTH, as_json=True)
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": ["-1"]}]
    assert meta["outputs"][0]["name"] == "pixels" and meta["outputs"][0]["datatype"] == "FP16"
    assert c.is_model_ready(MODEL, headers=AUTH)
    assert c.get_server_metadata(headers=AUTH).name == "nicoffload"


@pytest.mark.parametrize(
    ("headers", "words"),
    [({}, "missing bearer token"), ({"authorization": "Bearer nope"}, "wrong bearer token")],
)
def test_infer_without_or_with_a_wrong_token_is_unauthenticated(server, images, headers, words):
    err = refused(client(server), [image_input(images[:1])], headers=headers)
    assert err.status() == "StatusCode.UNAUTHENTICATED" and words in err.message()


def test_unknown_model_is_not_found(server, images):
    err = refused(client(server), [image_input(images[:1])], model="resnet")
    assert err.status() == "StatusCode.NOT_FOUND" and "unknown model 'resnet'" in err.message()
    with pytest.raises(InferenceServerException) as meta:
        client(server).get_model_metadata("resnet", headers=AUTH)
    assert meta.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize(
    ("name", "datatype", "shape", "words"),
    [
        ("images", "BYTES", [1], "unknown input 'images'"),
        ("image", "FP32", [1], "datatype FP32, expected BYTES"),
        ("image", "BYTES", [1, 1], "expected [N]"),
    ],
)
def test_a_tensor_that_does_not_fit_is_invalid_argument(server, name, datatype, shape, words):
    i = grpcclient.InferInput(name, shape, datatype)
    n = int(np.prod(shape))
    data = np.array([b"x"] * n, dtype=object) if datatype == "BYTES" else np.zeros(n, np.float32)
    i.set_data_from_numpy(data.reshape(shape))
    err = refused(client(server), [i])
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and words in err.message()


def test_a_corrupt_jpeg_fails_its_request_alone(server, plan, images):
    want = nicoffload.run(PIPELINE, images, plan=plan).outputs["pixels"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bad = pool.submit(refused, client(server), [image_input([images[0][:300]])])
        goods = [
            pool.submit(client(server).infer, MODEL, [image_input(images)], headers=AUTH)
            for _ in range(3)
        ]
        err = bad.result()
        assert err.status() == "StatusCode.INVALID_ARGUMENT"
        assert "item 0: truncated" in err.message()
        for g in goods:
            assert g.result().as_numpy("pixels").tobytes() == want.tobytes()


def test_a_message_over_max_request_mb_is_resource_exhausted(server):
    err = refused(client(server), [image_input([b"\xff" * (5 << 20)])])
    assert err.status() == "StatusCode.RESOURCE_EXHAUSTED" and "larger than max" in err.message()


def test_a_request_larger_than_max_queue_is_resource_exhausted(server):
    err = refused(client(server), [image_input([b"x"] * 257)])
    assert err.status() == "StatusCode.RESOURCE_EXHAUSTED" and "--max-queue" in err.message()


def test_a_request_past_its_deadline_is_deadline_exceeded(server, images):
    err = refused(client(server), [image_input(images[:3])], timeout=1)  # Triton's us parameter
    assert err.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "3 of 3 items were not run" in err.message()


@pytest.fixture
def gated(plan, tmp_path):
    """A server (gRPC too) whose model blocks until the test opens its gate."""
    with gated_servers(plan, tmp_path, "--grpc", "127.0.0.1:0") as start:
        yield start


def test_past_max_queue_is_resource_exhausted_at_once(gated, tmp_path, images):
    s = gated("--max-queue", "2")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(client(s).infer, MODEL, [image_input(images[:2])])
        wait_for(tmp_path / "entered")  # its 2 items are in the model: the queue is full
        err = refused(client(s), [image_input(images[:1])], headers={})
        assert err.status() == "StatusCode.RESOURCE_EXHAUSTED" and "--max-queue" in err.message()
        (tmp_path / "open").touch()
        assert held.result().as_numpy("mean").shape == (2,)
    assert client(s).infer(MODEL, [image_input(images[:1])]).as_numpy("mean").shape == (1,)


def test_a_draining_server_is_unavailable_and_answers_in_flight(gated, tmp_path, images):
    s = gated()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(client(s).infer, MODEL, [image_input(images[:3])], "", None, "held")
        wait_for(tmp_path / "entered")
        s.proc.send_signal(signal.SIGTERM)
        other = client(s)
        # readiness goes false once the signal is handled
        wait_until(lambda: not other.is_server_ready(), "readiness to go false")
        err = refused(other, [image_input(images[:1])], headers={})
        assert err.status() == "StatusCode.UNAVAILABLE" and "draining" in err.message()
        (tmp_path / "open").touch()
        res = held.result()
        assert res.get_response().id == "held" and res.as_numpy("mean").shape == (3,)
    assert s.proc.wait(60) == 0
