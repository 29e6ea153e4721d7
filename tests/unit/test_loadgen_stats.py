"""loadgen's arithmetic: Poisson arrivals and the summary of a run's results."""

from __future__ import annotations

import numpy as np
import pytest

from nicoffload.cli.loadgen import parse_rates
from nicoffload.errors import UserError
from nicoffload.serve.kserve import parse_infer
from nicoffload.serve.loadgen import Result, arrivals, request_body, summarize


def test_arrivals_are_sorted_within_the_run_and_seeded():
    t = arrivals(200.0, 5.0, seed=1)
    assert np.all(np.diff(t) > 0) and t[0] >= 0 and t[-1] < 5.0
    np.testing.assert_array_equal(t, arrivals(200.0, 5.0, seed=1))
    assert not np.array_equal(t, arrivals(200.0, 5.0, seed=2))


def test_arrivals_average_the_rate_over_a_long_run():
    # 200/s over 500 s: 100,000 expected, sd 316; 2,000 is six sigma
    assert abs(len(arrivals(200.0, 500.0, seed=0)) - 100_000) < 2_000


def test_percentiles_goodput_and_errors():
    ok = [Result(200, ms / 1e3, {}) for ms in range(1, 1001)]
    bad = [Result(503, 0.001), Result(503, 0.002), Result(0, 0.5)]
    doc = summarize(ok + bad, duration_s=10.0, offered=100.0)
    assert doc["sent"] == 1003 and doc["ok"] == 1000
    assert doc["goodput_per_s"] == 100.0
    assert doc["errors_by_status"] == {"0": 1, "503": 2}
    assert doc["latency_ms"] == {"p50": 500.5, "p90": 900.1, "p99": 990.01, "p99.9": 999.001}
    assert doc["mean_latency_ms"] == 500.5


def test_breakdown_is_the_mean_of_the_answered_requests_only():
    rs = [
        Result(
            200, 0.010, {"queue_us": 1000, "pipeline_us": 6000, "server_us": 8000, "batches": 1}
        ),
        Result(
            200, 0.014, {"queue_us": 3000, "pipeline_us": 8000, "server_us": 12000, "batches": 1}
        ),
        Result(400, 0.001, {"queue_us": 99_000}),
    ]
    b = summarize(rs, 1.0, None)["breakdown_ms"]
    # in the order time passes; what the parts (not the server's total) leave of the 12 ms
    assert list(b.items()) == [
        ("queue_ms", 2.0),
        ("pipeline_ms", 7.0),
        ("server_ms", 10.0),
        ("unattributed_ms", 3.0),
    ]


def test_parts_that_cover_the_latency_attribute_all_of_it():
    parts = {"client_us": 100, "request_us": 400, "receive_us": 500, "host_us": 3000}
    rs = [Result(200, 0.004, parts | {"server_us": 3500})] * 3
    doc = summarize(rs, 1.0, 3.0)
    assert doc["attributed_ratio"] == 1.0 and doc["breakdown_ms"]["unattributed_ms"] == 0.0


def test_tail_breakdown_is_the_mean_of_the_slowest_one_percent():
    fast = [Result(200, 0.002, {"host_us": 2000})] * 99
    slow = [Result(200, 0.050, {"host_us": 2000, "batch_us": 48_000})]
    doc = summarize(fast + slow, 1.0, 100.0)
    assert doc["tail_breakdown_ms"] == {"host_ms": 2.0, "batch_ms": 48.0}
    assert doc["tail_latency_mean_ms"] == 50.0
    assert doc["breakdown_ms"]["batch_ms"] == 0.48


def test_no_answered_request_has_no_latency():
    doc = summarize([Result(503, 0.001)], 1.0, 10.0)
    assert doc["latency_ms"]["p99"] is None and doc["breakdown_ms"] == {}


def test_request_body_is_a_valid_binary_infer_request():
    body, headers = request_body("image", [b"\xff\xd8jpeg"])
    req = parse_infer(body, headers["Content-Type"], headers["Inference-Header-Content-Length"])
    assert req.inputs["image"].data == [b"\xff\xd8jpeg"] and req.binary_output


@pytest.mark.parametrize("text", ["", "0", "10,-1", "fast"])
def test_bad_rates_are_refused(text):
    with pytest.raises(UserError, match="--rate"):
        parse_rates(text)


def test_a_rate_list_sweeps():
    assert parse_rates("50, 100,200") == [50.0, 100.0, 200.0]
