"""One server's simulation against what queueing theory says of the same stations."""

from __future__ import annotations

import numpy as np
import pytest

from nicoffload.fleet.model import Route, StreamModel, Visit
from nicoffload.fleet.sim import Offered, simulate_server
from nicoffload.planner.plan import Predicted


def stream(*visits: Visit, size: int = 1, wait_ms: float = 0.0, **kw) -> StreamModel:
    return StreamModel(
        "p", "test", Route(visits, 0.0), size, wait_ms, 0.0, Predicted(0, 0, 0), {}, **kw
    )


def run(model: StreamModel, capacity: dict, rate: float, duration_s: float, host=()):
    (out,) = simulate_server(capacity, frozenset(host), [Offered(model, rate)], duration_s, seed=7)
    return out


def test_an_md1_queue_waits_as_the_pollaczek_khinchine_formula_says() -> None:
    # M/D/1: mean wait in queue rho * d / (2 (1 - rho)); at rho 0.6, d 1 ms: 0.75 ms
    d, rate = 1.0, 600.0
    out = run(stream(Visit("cpu", d)), {"cpu": 1}, rate, 100.0)
    rho = rate * d / 1e3
    assert out.latencies_ms.mean() == pytest.approx(d + rho * d / (2 * (1 - rho)), rel=0.04)


def test_a_lightly_loaded_queue_waits_little() -> None:
    d, rate = 1.0, 100.0  # rho 0.1: the mean wait is 0.056 ms
    out = run(stream(Visit("cpu", d)), {"cpu": 1}, rate, 100.0)
    assert out.latencies_ms.mean() == pytest.approx(d + 0.1 * d / 1.8, rel=0.02)


def test_a_saturated_tandem_completes_at_its_bottleneck_rate() -> None:
    model = stream(Visit("a", 0.5), Visit("b", 2.0))
    out = run(model, {"a": 1, "b": 1}, 1000.0, 20.0)
    assert out.goodput_per_s == pytest.approx(500.0, rel=0.02)


def test_a_batch_is_split_over_the_stations_servers() -> None:
    # backlogged batches of 4 on 4 servers: 2 ms per batch, 2,000 items/s
    out = run(stream(Visit("cpu", 2.0), size=4, wait_ms=1.0), {"cpu": 4}, 3000.0, 20.0)
    assert out.goodput_per_s == pytest.approx(2000.0, rel=0.02)


def test_a_stage_serves_one_batch_at_a_time() -> None:
    # batches of one item use one server of four, as the runtime's stage thread does
    out = run(stream(Visit("cpu", 2.0)), {"cpu": 4}, 3000.0, 20.0)
    assert out.goodput_per_s == pytest.approx(500.0, rel=0.02)


def test_two_pipelines_share_a_stations_servers() -> None:
    a, b = stream(Visit("cpu", 2.0)), stream(Visit("cpu", 2.0))
    offered = [Offered(a, 1000.0), Offered(b, 1000.0)]
    runs = simulate_server({"cpu": 1}, frozenset(), offered, 20.0, seed=7)
    assert sum(r.goodput_per_s for r in runs) == pytest.approx(500.0, rel=0.02)


def test_a_fractional_capacity_slows_its_servers_to_match() -> None:
    out = run(stream(Visit("cpu", 1.0)), {"cpu": 0.5}, 2000.0, 20.0)
    assert out.goodput_per_s == pytest.approx(500.0, rel=0.02)


def test_the_host_interpreter_caps_a_many_core_host_at_its_serial_rate() -> None:
    # 4 cores could do 2,000 items/s of 2 ms; 1 ms of each holds the one interpreter
    model = stream(Visit("cpu", 2.0, serial_ms=1.0), size=4, wait_ms=1.0)
    out = run(model, {"cpu": 4}, 3000.0, 20.0)
    assert out.goodput_per_s == pytest.approx(1000.0, rel=0.02)


def test_a_lone_item_waits_the_batch_wait_then_its_service() -> None:
    model = stream(Visit("cpu", 1.0), size=8, wait_ms=5.0)
    out = run(model, {"cpu": 1}, 1.0, 200.0)
    assert np.median(out.latencies_ms) == pytest.approx(6.0)


def test_under_backlog_batches_fill_so_a_per_batch_cost_is_shared() -> None:
    # 10 ms per batch whatever its size: full batches of 8 give 800 items/s
    model = stream(Visit("cpu", 0.0, batch_ms=10.0), size=8, wait_ms=2.0)
    out = run(model, {"cpu": 1}, 2000.0, 20.0)
    assert out.goodput_per_s == pytest.approx(800.0, rel=0.02)


def test_a_later_bottleneck_holds_back_the_ingress_so_batches_fill() -> None:
    # the stages' bounded queues carry the backpressure of stage b to the ingress: full
    # batches of 8 reach b, whose 10 ms per batch then gives 800 items/s
    model = stream(Visit("a", 0.01), Visit("b", 0.0, batch_ms=10.0), size=8, wait_ms=2.0)
    out = run(model, {"a": 1, "b": 1}, 2000.0, 20.0)
    assert out.goodput_per_s == pytest.approx(800.0, rel=0.02)


def test_a_link_delay_adds_to_every_latency() -> None:
    base = run(stream(Visit("cpu", 1.0)), {"cpu": 1}, 1.0, 100.0)
    model = StreamModel(
        "p", "t", Route((Visit("cpu", 1.0),), 3.0), 1, 0.0, 0, Predicted(0, 0, 0), {}
    )
    delayed = run(model, {"cpu": 1}, 1.0, 100.0)
    assert np.median(delayed.latencies_ms) - np.median(base.latencies_ms) == pytest.approx(3.0)


def test_host_cpu_counts_only_the_host_stations() -> None:
    model = stream(Visit("cpu", 1.0, batch_ms=0.5), Visit("dpu0", 3.0))
    out = run(model, {"cpu": 1, "dpu0": 1}, 50.0, 100.0, host={"cpu"})
    done = out.goodput_per_s * out.window_s
    assert out.host_cpu_ms / done == pytest.approx(1.5, rel=0.01)  # batches of one


def test_host_assist_sends_batches_the_hosts_way_when_the_agent_holds_a_batch() -> None:
    host = Route((Visit("cpu", 2.0),), 0.0)
    model = stream(
        Visit("dpu0", 2.0), size=4, wait_ms=1.0, assist_route=host, assist_station="dpu0"
    )
    out = run(model, {"cpu": 1, "dpu0": 1}, 900.0, 20.0)
    assert out.assisted > 0
    assert out.goodput_per_s > 550.0  # more than the agent's 500 items/s alone


def test_an_overloaded_server_leaves_items_unfinished() -> None:
    out = run(stream(Visit("cpu", 2.0)), {"cpu": 1}, 1000.0, 10.0)
    assert out.unfinished > 0


def test_a_trace_of_arrivals_is_replayed_as_given() -> None:
    model = stream(Visit("cpu", 1.0))
    trace = np.array([100.0, 100.0, 5000.0])
    (out,) = simulate_server({"cpu": 1}, frozenset(), [Offered(model, 0.3, trace)], 10.0, 0, 0.0)
    assert out.latencies_ms.tolist() == [1.0, 1.0, 2.0]  # sorted: the second waited 1 ms
