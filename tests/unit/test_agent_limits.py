"""Bounds on what a token holder can make the agent keep or reach (issue #17, findings 7, 8):
request ids remembered in constant memory, a batch's failed rows within MAX_META, stage labels
bounded, forward_to limited to the operator's addresses, wrong tokens limited per address,
and tokenizers named by id, never by a path."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from dpu_agents.config import load_config, may_forward
from dpu_agents.metrics import MAX_LABELS, Metrics
from dpu_agents.seen import SeenIds
from dpu_agents.server import AuthLimit
from dpu_agents.session import failed_meta
from nicoffload.errors import SpecError, UserError
from nicoffload.graph import load_pipeline
from nicoffload.ops.tokenize import tokenizer_by_id
from nicoffload.runtime.remote import failed_of
from nicoffload.transport.frame import MAX_META, decode_meta, encode_meta

ROOT = Path(__file__).resolve().parents[2]
BERT_JSON = ROOT / "nicoffload" / "data" / "bert-base-uncased.json"

# --- request ids ---------------------------------------------------------------------------


class Reference:
    """What SeenIds must answer, the obvious way: every id kept, and the window's rule."""

    def __init__(self, span: int) -> None:
        self.span, self.ids, self.high = span, set(), -1

    def add(self, rid: int) -> bool:
        if rid in self.ids or rid <= self.high - self.span:
            return False
        self.ids.add(rid)
        self.high = max(self.high, rid)
        return True


@pytest.mark.parametrize("span", [1, 7, 64, 1000])
def test_seen_ids_answer_as_a_set_of_every_id_would_within_the_window(span: int) -> None:
    rng = random.Random(span)
    seen, ref = SeenIds(span), Reference(span)
    rid = 0
    for _ in range(20_000):
        step = rng.choice([0, 1, 1, 1, 2, -1, -3, span - 1, span, span + 5, 3 * span, -span])
        rid = max(0, rid + step)
        assert seen.add(rid) == ref.add(rid), (rid, seen.high)


def test_a_repeated_id_is_seen_and_an_id_older_than_the_window_is_refused() -> None:
    seen = SeenIds(4)
    got = [seen.add(i) for i in (7, 7, 8, 5, 5, 4, 9, 6, 5)]
    assert got == [True, False, True, True, False, False, True, True, False]


def test_a_million_ids_take_the_same_memory_as_none() -> None:
    seen = SeenIds(1 << 20)
    before = len(seen._bits)
    assert all(seen.add(i) for i in range(0, 3_000_000, 3))
    assert len(seen._bits) == before == (1 << 20) // 8  # 128 KiB, not 80 MB of a dict
    assert not seen.add(2_999_997) and seen.add(2_999_998)


def test_a_dedup_window_of_more_than_2_mib_a_session_is_refused(tmp_path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f"dedup_window = {1 << 24}\n")
    assert load_config(path).dedup_window == 1 << 24
    path.write_text(f"dedup_window = {(1 << 24) + 1}\n")
    with pytest.raises(UserError, match="'dedup_window' must be at most 16777216"):
        load_config(path)


# --- failed rows ---------------------------------------------------------------------------

REASONS = ["bad_request", "unsupported_format", "truncated", "too_large", "agent_draining"]


def batch_meta(ids: list[int], failed: dict[int, tuple[str, str]]) -> dict:
    meta = {"request_ids": ids, **failed_meta(ids, failed), "sent_ns": 1 << 62}
    return decode_meta(encode_meta(meta))  # what the host gets, or ValueError past MAX_META


@pytest.mark.parametrize("first_id", [0, 1 << 40])
def test_4096_failed_rows_fit_the_meta_and_each_keeps_its_reason(first_id: int) -> None:
    ids = list(range(first_id, first_id + 4096))
    failed = {row: (REASONS[row % 5], f"item {row}: " + "x" * 900) for row in range(4096)}
    meta = batch_meta(ids, failed)
    assert len(encode_meta(meta)) <= MAX_META - 2048  # room for what else a batch says
    got = failed_of(meta)
    assert got == {ids[r]: (why, got[ids[r]][1]) for r, (why, _) in failed.items()}
    assert got[ids[0]][1] == failed[0][1][:500]  # the first rows keep their own detail


def test_a_few_failed_rows_are_sent_by_id_with_their_details() -> None:
    failed = {1: ("truncated", "JPEG cut at byte 1234"), 3: ("bad_request", "no 'text'")}
    meta = batch_meta([10, 11, 12, 13], failed)
    assert meta["failed"] == {11: ["truncated", "JPEG cut at byte 1234"], 13: list(failed[3])}
    assert "failed_rows" not in meta
    assert failed_of(meta) == {11: failed[1], 13: failed[3]}


# --- metrics labels ------------------------------------------------------------------------


def test_stage_labels_are_bounded_and_the_least_recently_used_go_first() -> None:
    metrics = Metrics()
    metrics.item("kept", 0.001, True)
    for i in range(1000):
        metrics.item(f"s{i}-" + "n" * 58, 0.001, True)
        metrics.depth(f"ingress:s{i}-" + "n" * 50, 1)
        if i % 100 == 0:
            metrics.item("kept", 0.001, True)  # a live session's stage keeps its series
    text = generate_latest(metrics.registry).decode()
    stages = {
        line.split('stage="')[1].split('"')[0] for line in text.splitlines() if 'stage="' in line
    }
    assert len(stages) == MAX_LABELS and "kept" in stages and f"s999-{'n' * 58}" in stages
    queues = {
        line.split('queue="')[1].split('"')[0] for line in text.splitlines() if 'queue="' in line
    }
    assert len(queues) == MAX_LABELS
    assert len(metrics.snapshot()["stages"]) == MAX_LABELS
    assert len(metrics.snapshot()["queue_depth"]) == MAX_LABELS


# --- forward_to ----------------------------------------------------------------------------

ALLOW = ("10.0.0.0/24", "fd00::/64")


@pytest.mark.parametrize(
    ("target", "client", "ok"),
    [
        ("tcp://192.168.100.1:4000", "192.168.100.1", True),  # the client's own address
        ("tcp://192.168.100.2:4000", "192.168.100.1", False),
        ("rdma://192.168.100.1:0?device=mlx5_0", "192.168.100.1", True),
        ("tcp://10.0.0.77:22", "192.168.100.1", True),  # in forward_allow
        ("tcp://10.0.1.77:22", "192.168.100.1", False),
        ("tcp://[fd00::5]:80", "192.168.100.1", True),
        ("tcp://[::ffff:192.168.100.1]:80", "192.168.100.1", True),
        ("tcp://192.168.100.1:80", "::ffff:192.168.100.1", True),
        ("tcp://localhost:4000", "127.0.0.1", False),  # a name is never resolved
        ("tcp://internal.example:80", "192.168.100.1", False),
        ("tcp://[zz]:80", "127.0.0.1", False),
        ("shm://ring", "127.0.0.1", True),  # a segment of this machine, for a client on it
        ("shm://ring", "192.168.100.9", True),  # ... connected to this machine's own address
        ("shm://ring", "192.168.100.1", False),
    ],
)
def test_forward_to_goes_only_where_the_operator_allows(target, client, ok) -> None:
    assert may_forward(target, client, "192.168.100.9", ALLOW) is ok


def test_forward_allow_entries_are_checked_when_the_config_is_read(tmp_path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('forward_allow = ["10.0.0.0/24", "fd00::/64"]\n')
    assert load_config(path).forward_allow == ALLOW
    path.write_text('forward_allow = ["10.0.0.0/24", "the lab"]\n')
    with pytest.raises(UserError, match="'forward_allow': 'the lab' is not an address"):
        load_config(path)
    path.write_text('forward_allow = "10.0.0.0/24"\n')
    with pytest.raises(UserError, match="'forward_allow' must be of type"):
        load_config(path)


# --- failed logins -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_with_too_many_wrong_tokens_is_blocked_for_a_while() -> None:
    clock = Clock()
    limit = AuthLimit(3, window_s=10.0, block_s=30.0, clock=clock)
    for _ in range(2):
        limit.failed("10.0.0.7")
    assert not limit.blocked("10.0.0.7")
    limit.failed("10.0.0.7")
    assert limit.blocked("10.0.0.7") and not limit.blocked("10.0.0.8")
    clock.now += 29.0
    assert limit.blocked("10.0.0.7")
    clock.now += 1.5
    assert not limit.blocked("10.0.0.7")


def test_wrong_tokens_spread_wider_than_the_window_do_not_block() -> None:
    clock = Clock()
    limit = AuthLimit(3, window_s=10.0, block_s=30.0, clock=clock)
    for _ in range(10):
        limit.failed("10.0.0.7")
        clock.now += 6.0
    assert not limit.blocked("10.0.0.7")


def test_the_addresses_followed_and_blocked_are_bounded() -> None:
    limit = AuthLimit(2, window_s=10.0, block_s=30.0, clock=Clock())
    for i in range(3 * AuthLimit.MAX_ADDRESSES):
        for _ in range(2):
            limit.failed(f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}")
    assert len(limit._failures) == len(limit._until) == AuthLimit.MAX_ADDRESSES
    assert limit.blocked("10.0.47.255") and not limit.blocked("10.0.0.1")  # newest kept


# --- tokenizers by id ----------------------------------------------------------------------

TEXT_PIPELINE = """\
name: tiny-text
inputs: {text: {kind: text}}
nodes:
  - {name: tok, op: tokenize, in: text, params: {tokenizer: TOKENIZER, max_length: 8}}
outputs: {ids: tok.input_ids}
"""


@pytest.fixture
def tokenizers(tmp_path: Path) -> Path:
    folder = tmp_path / "tokenizers"
    folder.mkdir()
    (folder / "my-bert@v2.json").write_bytes(BERT_JSON.read_bytes())
    return folder


@pytest.mark.parametrize(
    "value", ["/etc/passwd", "../../etc/passwd", "tokenizers/my-bert@v2.json", ".hidden", ""]
)
def test_a_path_is_no_tokenizer_id(tokenizers, value) -> None:
    with pytest.raises(ValueError, match="must be a tokenizer id on an agent"):
        tokenizer_by_id("tokenizer", value, str(tokenizers))


def test_an_id_is_a_shipped_tokenizer_or_a_file_of_the_operators_folder(tokenizers) -> None:
    assert tokenizer_by_id("tokenizer", "bert-base-uncased", "") == str(BERT_JSON)
    mine = tokenizer_by_id("tokenizer", "my-bert@v2", str(tokenizers))
    assert mine == str((tokenizers / "my-bert@v2.json").resolve())
    with pytest.raises(
        ValueError, match=r"has no tokenizer 'passwd' \(it has: bert-base-uncased, my-bert@v2\)"
    ):
        tokenizer_by_id("tokenizer", "passwd", str(tokenizers))


def test_an_id_that_is_a_fifo_or_too_big_in_the_folder_is_not_opened(tokenizers) -> None:
    os.mkfifo(tokenizers / "fifo.json")
    with pytest.raises(ValueError, match="has no tokenizer 'fifo'"):
        tokenizer_by_id("tokenizer", "fifo", str(tokenizers))


def test_a_loaded_pipeline_naming_a_path_is_refused_at_the_value(tmp_path, tokenizers) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(TEXT_PIPELINE.replace("TOKENIZER", str(BERT_JSON)))
    assert load_pipeline(path).node("tok").params["tokenizer"] == str(BERT_JSON)  # the host
    with pytest.raises(SpecError) as info:
        load_pipeline(path, str(tokenizers))  # an agent
    assert (info.value.mark.line, info.value.mark.column) == (4, 61)
    assert "parameter 'tokenizer' must be a tokenizer id on an agent" in info.value.message


def test_a_loaded_pipeline_naming_an_id_gets_the_operators_file(tmp_path, tokenizers) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(TEXT_PIPELINE.replace("TOKENIZER", "my-bert@v2"))
    tok = load_pipeline(path, str(tokenizers)).node("tok")
    assert tok.params["tokenizer"] == str((tokenizers / "my-bert@v2.json").resolve())
    path.write_text(TEXT_PIPELINE.replace("{tokenizer: TOKENIZER, ", "{"))
    assert load_pipeline(path, "").node("tok").params["tokenizer"] == str(BERT_JSON)
