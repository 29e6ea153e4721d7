"""tokenize: text -> input_ids and attention_mask, padded and truncated to max_length.

The vocabulary is a Hugging Face `tokenizers` file (`tokenizer.json`), named in the pipeline;
`bert-base-uncased` is shipped. Outputs equal `tokenizers`' own encoding exactly. On the host
`tokenizer` may be a path; in a pipeline LOADed into an agent it is an id (`tokenizer_by_id`):
a shipped name or `<id>.json` in the directory the agent's operator configured, never a path.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
from pathlib import Path

import numpy as np

from nicoffload.errors import ItemError
from nicoffload.graph import TensorSpec
from nicoffload.ops import DATA_DIR, Param, ParamError, WiringError, kernel, op

# Characters no vocabulary holds (Unicode private use): a tokenizer that cannot encode them has
# no unknown token and would fail every item with a word outside its vocabulary.
_PROBE = "nicoffload \U000f0000\U000f0001"


TOKENIZER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")  # no '/': nothing but a name
MAX_TOKENIZER_BYTES = 64 << 20  # an agent's tokenizer file (bert-base-uncased: 0.7 MB)


def tokenizer_by_id(param: str, value: object, directory: str) -> str:
    """The file of the tokenizer `value` names on an agent: a shipped one, else `<id>.json`
    (or `<id>` if it ends so: a pipeline that names `my-tok.json`, next to it on the host,
    names the same file of the agent) in `directory` (the operator's `tokenizer_dir`; "" for
    none), a regular file of at most MAX_TOKENIZER_BYTES. A path, or an id not there, is a
    ParamError that names only ids."""
    if not isinstance(value, str) or not TOKENIZER_ID.fullmatch(value):
        raise ParamError(
            param,
            f"parameter '{param}' must be a tokenizer id on an agent (a name of up to 64 of "
            f"A-Z a-z 0-9 _ . @ -, not a path), got {str(value)[:80]!r}: name a shipped one, or "
            "a file of the agent's tokenizer_dir by its name (`my-tok.json`), or pin the node "
            "to the host",
        )
    name = value if value.endswith(".json") else f"{value}.json"
    for folder in (DATA_DIR, *((Path(directory),) if directory else ())):
        path = folder / name
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_TOKENIZER_BYTES:
            return str(path.resolve())
    ids = sorted(p.stem for p in DATA_DIR.glob("*.json"))
    if directory:
        ids += sorted(p.stem for p in Path(directory).glob("*.json"))[:50]
    raise ParamError(
        param,
        f"parameter '{param}': this agent has no tokenizer {value!r} (it has: {', '.join(ids)})",
    )


def _work(params, in_specs, out_specs) -> float:
    return float(params["max_length"])


def _check(params: dict) -> None:
    """Read the tokenizer when the pipeline is loaded, so `validate` and `plan` refuse a file
    that `run` could not use: not a tokenizer.json, or one that fails on an unknown word."""
    path = params["tokenizer"]
    try:
        tok = load_tokenizer(params)
    except Exception as exc:  # tokenizers raises a bare Exception with its parser's message
        raise ParamError(
            "tokenizer",
            f"parameter 'tokenizer': '{path}' is not a Hugging Face tokenizer file "
            f"(tokenizer.json): {_why_not(path, exc)}",
        ) from None
    try:
        tok.encode(_PROBE, add_special_tokens=params["add_special_tokens"])
    except Exception as exc:
        raise ParamError(
            "tokenizer",
            f"parameter 'tokenizer': '{path}' fails on a word outside its vocabulary ({exc}); "
            "give its model an unknown token that its vocabulary holds "
            '(e.g. "unk_token": "[UNK]" with "[UNK]" in "vocab")',
        ) from None


@op(
    "tokenize",
    params=[
        Param(
            "tokenizer",
            "path",
            "bert-base-uncased",
            doc="a shipped name, or a tokenizer.json path (on an agent: an id of its tokenizer_dir)",
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
    check=_check,
)
def tokenize(params, in_specs):
    """Tokenize text with a WordPiece/BPE/Unigram tokenizer into fixed-length id and mask rows."""
    (src,) = in_specs
    if src.dtype != "str":
        raise WiringError(f"tokenize reads text, got {src}")
    spec = TensorSpec(params["dtype"], (params["max_length"],))
    return {"input_ids": spec, "attention_mask": spec}


def _why_not(path: str, exc: Exception) -> str:
    """What is wrong with a file `tokenizers` refused, in the user's terms (its own message
    speaks of its parser's structures: "expected `,` or `}` at line 1 column 9")."""
    try:
        doc = json.loads(Path(path).read_bytes())
    except UnicodeDecodeError:
        return "it is not text (a binary file?)"
    except ValueError as err:
        return f"it is not JSON ({err})"
    except OSError as err:
        return f"cannot read it ({err.strerror or err})"
    if not isinstance(doc, dict) or "model" not in doc:
        return (
            "JSON without a 'model' (a tokenizer.json has 'model', 'normalizer', 'pre_tokenizer')"
        )
    return str(exc)


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
        elif isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer takes it
                raise ItemError(
                    "bad_text", f"not valid Unicode: {exc.reason} at {exc.start}"
                ) from None
        try:
            enc = tok.encode(text, add_special_tokens=special)
        except TypeError:
            raise  # not a text at all: the caller's bug, which fails the run with its cause
        except Exception as exc:  # the load-time check makes this rare: one text, not the run
            raise ItemError("tokenize_failed", str(exc)) from None
        ids, mask = out if out is not None else (np.empty(n, dtype), np.empty(n, dtype))
        ids[:] = enc.ids
        mask[:] = enc.attention_mask
        return ids, mask

    return fn


@kernel("tokenize", "dpu")
def tokenize_dpu(nodes, consumers):
    """The same Rust tokenizer on the DPU's Arm cores (wheels exist for aarch64)."""
    return tokenize_cpu(nodes, consumers)
