"""tokenize: text -> input_ids and attention_mask, padded and truncated to max_length.

The vocabulary is a Hugging Face `tokenizers` file (`tokenizer.json`), named in the pipeline;
`bert-base-uncased` is shipped. Outputs equal `tokenizers`' own encoding exactly.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from nicoffload.errors import ItemError
from nicoffload.graph import TensorSpec
from nicoffload.ops import Param, WiringError, kernel, op


def _work(params, in_specs, out_specs) -> float:
    return float(params["max_length"])


@op(
    "tokenize",
    params=[
        Param(
            "tokenizer", "path", "bert-base-uncased", doc="tokenizer.json path, or a shipped name"
        ),
        Param(
            "max_length",
            "int",
            128,
            minimum=2,
            doc="pad or truncate every text to this many tokens",
        ),
        Param("dtype", "str", "int64", choices=("int64", "int32")),
        Param("add_special_tokens", "bool", True, doc="add [CLS]/[SEP] (or the tokenizer's own)"),
    ],
    outputs=("input_ids", "attention_mask"),
    work=_work,
    work_unit="tokens",
)
def tokenize(params, in_specs):
    """Tokenize text with a WordPiece/BPE/Unigram tokenizer into fixed-length id and mask rows."""
    (src,) = in_specs
    if src.dtype != "str":
        raise WiringError(f"tokenize reads text, got {src}")
    spec = TensorSpec(params["dtype"], (params["max_length"],))
    return {"input_ids": spec, "attention_mask": spec}


def load_tokenizer(params: dict):
    """A `tokenizers.Tokenizer` set to pad and truncate to max_length; one per file (as it is
    on disk) and length, shared by the nodes that use it (a 40-caption pipeline parsed its
    vocabulary 40 times, 0.05 s each). Encoding does not change it, so threads may share it."""
    path = params["tokenizer"]
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = None  # from_file reports it
    return _tokenizer(path, stamp, params["max_length"])


@functools.lru_cache(maxsize=32)
def _tokenizer(path: str, stamp: int | None, max_length: int):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    tok.enable_truncation(max_length=max_length)
    pad_id = tok.token_to_id("[PAD]")
    tok.enable_padding(length=max_length, pad_id=pad_id if pad_id is not None else 0)
    return tok


@kernel("tokenize", "cpu")
def tokenize_cpu(nodes, consumers):
    """Rust `tokenizers` on the calling thread."""
    (node,) = nodes
    tok = load_tokenizer(node.params)
    special = node.params["add_special_tokens"]
    dtype = np.dtype(node.params["dtype"])
    n = node.params["max_length"]

    def fn(text, out=None):
        if isinstance(text, (bytes, bytearray, memoryview)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ItemError("bad_text", f"not UTF-8: {exc}") from None
        enc = tok.encode(text, add_special_tokens=special)
        ids, mask = out if out is not None else (np.empty(n, dtype), np.empty(n, dtype))
        ids[:] = enc.ids
        mask[:] = enc.attention_mask
        return ids, mask

    return fn


@kernel("tokenize", "dpu")
def tokenize_dpu(nodes, consumers):
    """The same Rust tokenizer on the DPU's Arm cores (wheels exist for aarch64)."""
    return tokenize_cpu(nodes, consumers)
