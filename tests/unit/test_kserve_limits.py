"""Requests that would cost the server more than they are worth are refused with a 4xx before
the work (each was a 500, or stalled every other request, in review): too many elements for the
queue, JSON too large to parse or to answer, JSON nested too deep, shapes and timeouts out of
range, a bearer token that is not text."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from nicoffload.serve import kserve
from nicoffload.serve.kserve import MAX_JSON_ELEMENTS, RequestError


def _binary(count: int) -> tuple[bytes, str]:
    data = struct.pack("<I", 0) * count
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "BYTES",
                    "shape": [count],
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    return head + data, str(len(head))


def test_a_bytes_input_of_more_elements_than_the_queue_takes_is_413_before_it_is_read():
    body, n = _binary(1000)
    with pytest.raises(RequestError) as e:
        kserve.parse_infer(body, "application/octet-stream", n, max_items=256)
    assert e.value.status == 413 and "--max-queue 256" in e.value.message
    assert len(kserve.parse_infer(body, "application/octet-stream", n).inputs["image"].data) == 1000


def test_json_data_too_large_must_come_as_binary():
    count = MAX_JSON_ELEMENTS + 1
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [count], "data": [0.0] * count}]}
    ).encode()
    with pytest.raises(RequestError, match="binary_data_size") as e:
        kserve.parse_infer(body, "application/json", None)
    assert e.value.status == 413


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[" * 100_000, "nested too deep"),
        (
            json.dumps(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [[[[1.0]]]]}]}
            )
            .replace("[[[[1.0]]]]", "[" * 5000 + "1.0" + "]" * 5000)
            .encode(),
            "nested too deep",
        ),
        (
            json.dumps(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**70]}]}
            ).encode(),
            "shape",
        ),
        (
            json.dumps(
                {
                    "parameters": {"timeout": 10**400},
                    "inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}],
                }
            ).encode(),
            "timeout",
        ),
    ],
)
def test_out_of_range_requests_are_400_not_500(body, words):
    with pytest.raises(RequestError, match=words) as e:
        req = kserve.parse_infer(body, "application/json", None)
        req.timeout_us  # noqa: B018  (the timeout is checked when it is read)
    assert e.value.status == 400


def test_a_response_too_large_for_json_is_refused_before_it_runs():
    meta = [{"name": "pixels", "datatype": "FP16", "shape": [-1, 3, 224, 224]}]
    json_req = kserve.InferRequest(None, {}, {}, None, False)
    with pytest.raises(RequestError, match="binary") as e:
        kserve.check_json_outputs(json_req, meta, 8)  # 8 x 150,528 elements
    assert e.value.status == 413
    kserve.check_json_outputs(json_req, meta, 1)  # one item: small enough
    kserve.check_json_outputs(kserve.InferRequest(None, {}, {}, None, True), meta, 64)
    kserve.check_json_outputs(kserve.InferRequest(None, {}, {}, {"pixels": True}, False), meta, 64)


def test_a_bearer_token_that_is_not_text_is_refused_not_an_error():
    from nicoffload.serve.server import Server

    server = Server.__new__(Server)
    server.config = type("C", (), {"token": "s3cret-token-of-32-characters-xx"})()
    assert server.refuse_token("Bearer \udcff\udcfe") == "wrong bearer token"
    assert server.refuse_token("Bearer s3cret-token-of-32-characters-xx") is None
    assert np.dtype("<f2") == kserve.DATATYPES["FP16"]
