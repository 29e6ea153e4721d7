"""`nicoffload serve`'s checks of its arguments, before anything is opened."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from nicoffload.cli.serve import (
    check_servable,
    grpc_module,
    load_model,
    model_outputs,
    parse_listen,
    read_token,
)
from nicoffload.errors import MissingDependency, UserError
from nicoffload.graph import load_pipeline


def test_listen_is_host_and_port():
    assert parse_listen("0.0.0.0:8000") == ("0.0.0.0", 8000)
    assert parse_listen(":0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    for bad in ("8000", "host:", "host:99999", "host:http"):
        with pytest.raises(UserError, match="--listen"):
            parse_listen(bad)


def test_an_empty_token_file_is_refused(tmp_path):
    (tmp_path / "t").write_text("  \n")
    with pytest.raises(UserError, match="empty"):
        read_token(tmp_path / "t")
    (tmp_path / "t").write_text("abc\n")
    assert read_token(tmp_path / "t") == "abc"


def test_model_reference_errors_name_what_is_wrong():
    with pytest.raises(UserError, match="MODULE:CALLABLE"):
        load_model("nocolon")
    with pytest.raises(UserError, match="cannot import 'no_such_module_x'"):
        load_model("no_such_module_x:f")
    with pytest.raises(UserError, match="no callable 'nope'"):
        load_model("numpy:nope")


def test_model_outputs_come_from_a_warm_up_row(root):
    pipeline = load_pipeline(root / "pipelines" / "resnet50.yaml")

    def logits(outs):
        return {"logits": np.zeros((len(outs["pixels"]), 1000), np.float32)}

    assert model_outputs(logits, pipeline) == [
        {"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}
    ]
    with pytest.raises(UserError, match="warm-up call"):
        model_outputs(lambda outs: 3, pipeline)


def test_a_pipeline_whose_output_varies_per_item_cannot_be_served(tmp_path):
    p = tmp_path / "decode.yaml"
    p.write_text(
        textwrap.dedent(
            """
            name: decode-only
            inputs: {image: {kind: bytes, format: jpeg}}
            nodes:
              - {name: decode, op: decode_image, in: image}
            outputs: {rgb: decode}
            batch: {max_size: 8, max_wait_ms: 2}
            """
        )
    )
    with pytest.raises(UserError, match=r"output 'rgb' is .* varies per item"):
        check_servable(load_pipeline(p))


def test_grpc_without_its_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "grpc", None)  # `import grpc` raises ImportError
    monkeypatch.delitem(sys.modules, "nicoffload.serve.grpc_server", raising=False)
    with pytest.raises(MissingDependency, match=r"serve --grpc .*pip install 'nicoffload\[grpc\]'"):
        grpc_module()


def test_a_bad_grpc_address_names_the_option():
    with pytest.raises(UserError, match="--grpc 'nohost'"):
        parse_listen("nohost", "--grpc")
