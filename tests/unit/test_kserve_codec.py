"""The KServe v2 codec against the official Triton client's own encoder and decoder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from nicoffload.graph import load_pipeline
from nicoffload.serve import kserve, kserve_out
from nicoffload.serve.kserve import RequestError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def resnet():
    return load_pipeline(ROOT / "pipelines" / "resnet50.yaml")


@pytest.fixture(scope="module")
def clip():
    return load_pipeline(ROOT / "pipelines" / "clip.yaml")


def triton_body(inputs, **kw):
    """What tritonclient sends: the body, no Content-Type, the header length (or None)."""
    body, header = httpclient.InferenceServerClient.generate_request_body(inputs, **kw)
    return body, "", None if header is None else str(header)


def bytes_input(name, elements, binary=True):
    i = httpclient.InferInput(name, [len(elements)], "BYTES")
    i.set_data_from_numpy(np.array(elements, dtype=object), binary_data=binary)
    return i


def test_binary_bytes_input_from_the_triton_client_is_one_item_per_element(resnet):
    body, ctype, header = triton_body([bytes_input("image", [b"\xff\xd8a", b"", b"xyz" * 9])])
    req = kserve.parse_infer(body, ctype, header)
    assert kserve.items_of(req, resnet) == [
        {"image": b"\xff\xd8a"},
        {"image": b""},
        {"image": b"xyz" * 9},
    ]
    assert req.binary_output  # no outputs named: the client asks for binary outputs


def test_a_content_type_that_is_given_must_fit():
    body, _, header = triton_body([bytes_input("image", [b"a"])])
    assert kserve.parse_infer(body, "application/octet-stream", header).inputs["image"].data == [
        b"a"
    ]
    with pytest.raises(RequestError) as err:
        kserve.parse_infer(body, "text/plain", header)
    assert err.value.status == 415


def test_json_bytes_input_and_request_id(clip):
    body, ctype, header = triton_body(
        [
            bytes_input("image", [b"jpg"], binary=False),
            bytes_input("text", ["a cat"], binary=False),
        ],
        request_id="r-7",
    )
    req = kserve.parse_infer(body, ctype, header)
    assert header is None and req.id == "r-7"
    assert kserve.items_of(req, clip) == [{"image": b"jpg", "text": "a cat"}]


def test_typed_tensor_from_json_data_nested_and_from_binary():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    for binary in (False, True):
        i = httpclient.InferInput("x", [2, 3], "FP32")
        i.set_data_from_numpy(arr, binary_data=binary)
        req = kserve.parse_infer(*triton_body([i]))
        np.testing.assert_array_equal(req.inputs["x"].data, arr)
    nested = {
        "inputs": [{"name": "x", "datatype": "INT64", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]
    }
    req = kserve.parse_infer(json.dumps(nested).encode(), "application/json", None)
    assert req.inputs["x"].data.tolist() == [[1, 2], [3, 4]]


def test_timeout_parameter_is_microseconds(resnet):
    body, ctype, header = triton_body([bytes_input("image", [b"a"])], timeout=2500)
    assert kserve.parse_infer(body, ctype, header).timeout_us == 2500


@pytest.mark.parametrize(
    ("body", "ctype", "header", "status", "words"),
    [
        (b"{}", "text/plain", None, 415, "Content-Type"),
        (b"{not json", "application/json", None, 400, "not valid JSON"),
        (b"[1]", "application/json", None, 400, "JSON object"),
        (b'{"inputs": []}', "application/json", None, 400, "non-empty"),
        (
            b'{"inputs": [{"name": "x", "datatype": "F32", "shape": [1], "data": [1]}]}',
            "application/json",
            None,
            400,
            "unknown datatype",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}',
            "application/json",
            None,
            400,
            "1 elements",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}',
            "application/json",
            None,
            400,
            "shape",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": ["a"]}]}',
            "application/json",
            None,
            400,
            "not INT8",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 9}}]}',
            "application/octet-stream",
            "101",
            400,
            "body truncated",
        ),
        (b"{}", "application/octet-stream", "99", 400, "at most"),
    ],
)
def test_malformed_requests_are_refused_with_their_reason(body, ctype, header, status, words):
    with pytest.raises(RequestError) as err:
        kserve.parse_infer(body, ctype, header)
    assert err.value.status == status and words in err.value.message


def test_binary_bytes_element_truncated_is_named():
    good = serialize_byte_tensor(np.array([b"abcdef"], dtype=object)).item()
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": len(good) - 2},
                }
            ]
        }
    ).encode()
    with pytest.raises(RequestError, match="truncated at element 0"):
        kserve.parse_infer(head + good[:-2], "application/octet-stream", str(len(head)))


def test_binary_data_no_input_claims_is_refused():
    i = bytes_input("image", [b"a"])
    body, ctype, header = triton_body([i])
    with pytest.raises(RequestError, match="no input claims"):
        kserve.parse_infer(body + b"extra", ctype, header)


@pytest.mark.parametrize(
    ("tensors", "words"),
    [
        ([("images", "BYTES", [1])], "unknown input 'images'"),
        ([("image", "FP32", [1])], "datatype FP32, expected BYTES"),
        ([("image", "BYTES", [1, 1])], "expected [N]"),
        ([("image", "BYTES", [0])], "no items"),
    ],
)
def test_requests_that_do_not_fit_the_pipeline_inputs(resnet, tensors, words):
    inputs = []
    for name, dt, shape in tensors:
        i = httpclient.InferInput(name, shape, dt)
        n = int(np.prod(shape))
        data = np.array([b"x"] * n, dtype=object) if dt == "BYTES" else np.zeros(n, np.float32)
        i.set_data_from_numpy(data.reshape(shape))
        inputs.append(i)
    req = kserve.parse_infer(*triton_body(inputs))
    with pytest.raises(RequestError) as err:
        kserve.items_of(req, resnet)
    assert words in err.value.message and err.value.status == 400


def test_missing_input_and_lengths_that_differ(clip):
    req = kserve.parse_infer(*triton_body([bytes_input("image", [b"a"])]))
    with pytest.raises(RequestError, match="missing input 'text'"):
        kserve.items_of(req, clip)
    req = kserve.parse_infer(
        *triton_body([bytes_input("image", [b"a"]), bytes_input("text", [b"a", b"b"])])
    )
    with pytest.raises(RequestError, match="different lengths"):
        kserve.items_of(req, clip)


def test_text_that_is_not_utf8_is_refused(clip):
    req = kserve.parse_infer(
        *triton_body([bytes_input("image", [b"a"]), bytes_input("text", [b"\xff"])])
    )
    with pytest.raises(RequestError, match="not UTF-8"):
        kserve.items_of(req, clip)


def test_binary_response_decodes_with_the_triton_client_bit_for_bit():
    pixels = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float16)
    labels = np.array([b"cat", b"\x00dog"], dtype=object)
    req = kserve.InferRequest("q", {}, binary_output=True)
    body, headers = kserve_out.infer_response(
        "m", req, {"pixels": pixels, "labels": labels}, {"queue_us": 3}
    )
    res = httpclient.InferResult.from_response_body(
        body, header_length=int(headers[kserve.HEADER_LENGTH])
    )
    got = res.as_numpy("pixels")
    assert got.dtype == np.float16 and got.tobytes() == pixels.tobytes()
    assert res.as_numpy("labels").tolist() == [b"cat", b"\x00dog"]
    doc = res.get_response()
    assert doc["id"] == "q" and doc["parameters"] == {"queue_us": 3}


def test_json_response_when_an_output_asks_for_json_only():
    x = np.arange(4, dtype=np.int32).reshape(2, 2)
    req = kserve.InferRequest(None, {}, outputs={"x": False})
    body, headers = kserve_out.infer_response("m", req, {"x": x, "y": x})
    assert headers == {"Content-Type": "application/json"}
    doc = json.loads(body)
    assert [o["name"] for o in doc["outputs"]] == ["x"]
    assert doc["outputs"][0] == {
        "name": "x",
        "datatype": "INT32",
        "shape": [2, 2],
        "data": [0, 1, 2, 3],
    }
    assert "id" not in doc


def test_per_output_binary_data_mixes_json_and_binary():
    x = np.arange(3, dtype=np.float32)
    req = kserve.InferRequest(None, {}, outputs={"a": True, "b": False})
    body, headers = kserve_out.infer_response("m", req, {"a": x, "b": x})
    res = httpclient.InferResult.from_response_body(
        body, header_length=int(headers[kserve.HEADER_LENGTH])
    )
    np.testing.assert_array_equal(res.as_numpy("a"), x)
    np.testing.assert_array_equal(res.as_numpy("b"), x)


def test_unknown_requested_output_is_refused():
    req = kserve.InferRequest(None, {}, outputs={"logits": True})
    with pytest.raises(RequestError, match="unknown output 'logits'"):
        kserve.check_outputs(req, ["pixels"])


def test_pack_bytes_matches_tritons_serializer():
    elems = [b"", b"a", b"\xff" * 300]
    ours = kserve.pack_bytes(elems)
    assert ours == serialize_byte_tensor(np.array(elems, dtype=object)).item()
    assert list(deserialize_bytes_tensor(ours)) == elems
    assert kserve.unpack_bytes(ours, 3, "t") == elems


def test_model_metadata_of_the_resnet_pipeline(resnet):
    meta = kserve_out.model_metadata("resnet", resnet)
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "pixels", "datatype": "FP16", "shape": [-1, 3, 224, 224]}]


def test_error_body_is_the_protocols():
    assert json.loads(kserve_out.error_body("bad")) == {"error": "bad"}
