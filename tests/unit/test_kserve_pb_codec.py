"""The gRPC messages' codec against tritonclient.grpc's own request builder and result reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request

from nicoffload.graph import load_pipeline
from nicoffload.serve import kserve, kserve_out, kserve_pb
from nicoffload.serve.kserve import RequestError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def resnet():
    return load_pipeline(ROOT / "pipelines" / "resnet50.yaml")


def triton_request(inputs, outputs=None, request_id="", timeout=None):
    return _get_inference_request(
        "m", inputs, "", request_id, outputs, 0, False, False, 0, timeout, None
    )


def bytes_input(name, elements):
    i = grpcclient.InferInput(name, [len(elements)], "BYTES")
    i.set_data_from_numpy(np.array(elements, dtype=object))
    return i


def test_a_triton_request_is_one_item_per_bytes_element(resnet):
    msg = triton_request([bytes_input("image", [b"\xff\xd8a", b"", b"xyz" * 9])], request_id="r")
    req = kserve_pb.infer_request(msg)
    assert req.id == "r" and req.outputs is None and req.binary_output
    assert kserve.items_of(req, resnet) == [
        {"image": b"\xff\xd8a"},
        {"image": b""},
        {"image": b"xyz" * 9},
    ]


def test_the_timeout_parameter_is_the_request_timeout():
    req = kserve_pb.infer_request(triton_request([bytes_input("image", [b"a"])], timeout=250))
    assert req.timeout_us == 250


def test_contents_instead_of_raw_data_are_taken():
    msg = service_pb2.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="image", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"a", b"bc"])
    assert kserve_pb.infer_request(msg).inputs["image"].data == [b"a", b"bc"]
    msg = service_pb2.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="x", datatype="INT16", shape=[1, 2])
    t.contents.int_contents.extend([3, -4])
    arr = kserve_pb.infer_request(msg).inputs["x"].data
    assert arr.dtype == np.int16 and arr.tolist() == [[3, -4]]


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda m: m.inputs.add(name="x", datatype="FP16", shape=[1]), "raw_input_contents only"),
        (lambda m: m.inputs.add(name="x", datatype="INT7", shape=[1]), "unknown datatype"),
        (lambda m: m.inputs.add(name="x", datatype="BYTES", shape=[-1]), "whole numbers from 0"),
        (lambda m: m.inputs.add(name="x", datatype="BYTES", shape=[2]), "0 elements"),
        (lambda m: None, "non-empty"),
    ],
)
def test_a_malformed_message_is_refused_with_the_reason(build, words):
    msg = service_pb2.ModelInferRequest(model_name="m")
    build(msg)
    with pytest.raises(RequestError, match=words) as err:
        kserve_pb.infer_request(msg)
    assert err.value.status == 400


def test_raw_contents_must_be_one_per_input():
    msg = triton_request([bytes_input("a", [b"x"]), bytes_input("b", [b"y"])])
    del msg.raw_input_contents[1]
    with pytest.raises(RequestError, match="1 raw_input_contents for 2 inputs"):
        kserve_pb.infer_request(msg)


def test_raw_bytes_shorter_than_the_shape_are_refused():
    msg = triton_request([bytes_input("image", [b"abc"])])
    msg.raw_input_contents[0] = msg.raw_input_contents[0][:-1]
    with pytest.raises(RequestError, match="truncated at element 0"):
        kserve_pb.infer_request(msg)


def test_a_response_reads_back_through_the_triton_client():
    req = kserve_pb.infer_request(triton_request([bytes_input("image", [b"a"])], request_id="q"))
    pixels = np.arange(12, dtype=np.float16).reshape(2, 2, 3)
    labels = np.array([b"cat", b"dog"], dtype=object)
    resp = kserve_pb.infer_response("m", req, {"pixels": pixels, "labels": labels}, {"a_us": 7})
    result = grpcclient.InferResult(resp)
    assert result.as_numpy("pixels").tobytes() == pixels.tobytes()
    assert result.as_numpy("pixels").dtype == np.float16
    assert result.as_numpy("labels").tolist() == [b"cat", b"dog"]
    assert resp.id == "q" and resp.parameters["a_us"].int64_param == 7


def test_a_response_carries_only_the_named_outputs():
    out = grpcclient.InferRequestedOutput("labels")
    req = kserve_pb.infer_request(triton_request([bytes_input("image", [b"a"])], outputs=[out]))
    resp = kserve_pb.infer_response(
        "m", req, {"pixels": np.zeros((1, 2)), "labels": np.array([b"x"], dtype=object)}, {}
    )
    assert [o.name for o in resp.outputs] == ["labels"] and len(resp.raw_output_contents) == 1


def test_model_metadata_is_the_http_endpoints(resnet):
    meta = kserve_out.model_metadata("m", resnet)
    msg = kserve_pb.model_metadata(meta)
    assert [(t.name, t.datatype, list(t.shape)) for t in msg.inputs] == [("image", "BYTES", [-1])]
    assert [(t.name, list(t.shape)) for t in msg.outputs] == [("pixels", [-1, 3, 224, 224])]


def test_response_parameters_keep_their_types():
    req = kserve_pb.infer_request(triton_request([bytes_input("image", [b"a"])]))
    params = {"server_us": 12, "clock": "monotonic:abc", "flag": True}
    resp = kserve_pb.infer_response("m", req, {"pixels": np.zeros((1, 2))}, params)
    assert {k: kserve_pb.parameter(v) for k, v in resp.parameters.items()} == params
