"""Who holds the agent's connections: handshakes and sessions in separate pools, a share of the
handshakes per address, the oldest (silent first) displaced for the newest, never a refusal at
the door; and refusals logged as counts, not a line each."""

from __future__ import annotations

import logging

import pytest

from dpu_agents.admission import Admission
from dpu_agents.logs import Tally


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pools(limit: int = 4, per_address: int = 2, sessions: int = 2) -> tuple[Admission, Clock]:
    clock = Clock()
    return Admission(limit, per_address, sessions, deadline_s=3.0, clock=clock), clock


def test_an_address_over_its_share_displaces_its_own_oldest_handshake() -> None:
    a, _ = pools()
    assert a.admit("x1", "10.0.0.9") == [] and a.admit("c1", "10.0.0.1") == []
    assert a.admit("x2", "10.0.0.9") == []
    assert a.admit("x3", "10.0.0.9") == ["x1"]
    assert a.counts() == (3, 0)


def test_a_full_pool_displaces_the_oldest_handshake_of_the_busiest_address() -> None:
    a, _ = pools()
    for conn, address in [("c1", "10.0.0.1"), ("x1", "10.0.0.9"), ("y1", "10.0.0.8")]:
        a.admit(conn, address)
    a.admit("x2", "10.0.0.9")
    assert a.admit("c2", "10.0.0.2") == ["x1"]  # not c1, older but alone on its address
    assert a.admit("y2", "10.0.0.8") == ["c1"]  # one each: the oldest of all
    assert a.counts() == (4, 0)


def test_a_handshake_that_said_hello_goes_after_the_silent_ones() -> None:
    a, _ = pools(limit=8, per_address=3)
    a.admit("c1", "10.0.0.1", greeted=True)
    a.admit("x1", "10.0.0.1")
    a.admit("x2", "10.0.0.1")
    assert a.admit("x3", "10.0.0.1") == ["x1"]
    a.greeted("x2")
    assert a.admit("x4", "10.0.0.1") == ["x3"]
    assert a.admit("x5", "10.0.0.1") == ["x4"]
    a.greeted("x5")
    assert a.admit("x6", "10.0.0.1") == ["c1"]  # all greeted: the oldest


def test_sessions_have_their_own_pool() -> None:
    a, _ = pools(limit=2, sessions=1)
    a.admit("c1", "10.0.0.1")
    a.admit("c2", "10.0.0.2")
    assert a.promote("c1") == ""
    for i in range(5):  # strangers fill the handshakes: the session stays
        a.admit(f"x{i}", f"10.0.1.{i}")
    assert a.sessions() == ["c1"] and a.counts() == (2, 1)
    a.admit("c3", "10.0.0.3")
    assert a.promote("c3").startswith("too many connections (1 sessions)")
    assert a.counts() == (1, 1)  # c3 is forgotten


def test_a_displaced_handshake_cannot_become_a_session() -> None:
    a, _ = pools(per_address=1)
    a.admit("x1", "10.0.0.9")
    a.admit("x2", "10.0.0.9")
    assert a.promote("x1") == Admission.GONE
    assert a.promote("x2") == ""


def test_handshakes_past_the_deadline_expire_oldest_first() -> None:
    a, clock = pools()
    a.admit("c1", "10.0.0.1")
    clock.now = 2.0
    a.admit("c2", "10.0.0.2")
    clock.now = 3.5
    assert a.expired() == ["c1"]
    assert a.expired() == []
    clock.now = 5.0
    assert a.expired() == ["c2"] and a.counts() == (0, 0)


def test_forget_frees_either_pool() -> None:
    a, _ = pools()
    a.admit("c1", "10.0.0.1")
    a.admit("c2", "10.0.0.1")
    a.promote("c2")
    a.forget("c1")
    a.forget("c2")
    a.forget("never-seen")
    assert a.counts() == (0, 0) and a.all() == []


def test_a_flood_of_refusals_is_written_as_counts(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    tally = Tally(logging.getLogger("test.tally"), "auth_refused", every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test.tally"):
        tally.note("wrong token", "10.0.0.1:5000")
        for i in range(1000):
            tally.note("no HELLO within 3.0 s" if i % 2 else f"reason {i}", f"10.0.{i % 50}.1:1")
            clock.now += 0.001
        tally.flush()  # not due yet
        clock.now = 10.5
        tally.flush()
        tally.flush(force=True)  # nothing left
    records = [r.fields for r in caplog.records]
    assert records[0] == {"reason": "wrong token", "peer": "10.0.0.1:5000"}
    (summary,) = records[1:]
    assert summary["count"] == 1000 and summary["distinct_addresses"] == 50
    assert len(summary["reasons"]) <= Tally.MAX_KEYS + 1  # ...and "(other reasons)"
    assert summary["reasons"]["no HELLO within 3.0 s"] == 500
    assert sum(summary["reasons"].values()) == 1000
    assert len(summary["addresses"]) == Tally.MAX_KEYS
