"""The host-assist controller: how many rows of each batch the host takes while the agent is
busy (`runtime.assist.HostAssist`)."""

from __future__ import annotations

import pytest

from nicoffload.runtime.assist import HIGH, LOW, STEP, HostAssist


def test_an_agent_holding_less_than_a_batch_gets_the_whole_batch():
    a = HostAssist(0.5, 8)
    assert a.take(8, agent_holds=7, host_queued=0, workers=2) == 0
    assert a.outstanding == 0


def test_a_busy_agent_shares_the_batch_with_an_idle_host():
    a = HostAssist(0.5, 8)
    k = a.take(8, agent_holds=16, host_queued=0, workers=2)
    # the host had nothing left: its share went up a step before the split
    assert k == int((0.5 + STEP) * 8) and a.outstanding == k


def test_the_share_falls_while_the_host_is_behind_and_rises_once_it_has_caught_up():
    a = HostAssist(0.5, 10)
    a.take(10, 20, 0, 2)
    up = a.share
    a.take(10, 20, 0, 2)  # one batch's share not done yet: not behind
    assert a.share == pytest.approx(up)
    a.take(10, 20, 0, 2)  # two batches' share not done: more than this batch's share
    assert a.share == pytest.approx(up - STEP)
    a.done(a.outstanding)
    a.take(10, 20, 0, 2)
    assert a.share == pytest.approx(up)


def test_the_share_stays_between_its_bounds():
    a = HostAssist(0.99, 4)
    assert a.share == HIGH
    for _ in range(30):
        a.take(4, 8, 0, 1)  # never done: the host falls behind, every batch
    assert a.share == pytest.approx(LOW)
    assert HostAssist(0.0, 4).share == LOW


def test_a_host_busy_with_the_agents_rows_takes_nothing():
    a = HostAssist(0.5, 8)
    assert a.take(8, agent_holds=16, host_queued=3, workers=2) == 0


def test_assisted_rows_never_exceed_the_room_the_executor_keeps_for_them():
    a = HostAssist(0.9, 8)
    taken = [a.take(8, 64, a.outstanding, 100) for _ in range(20)]
    assert a.outstanding == sum(taken) <= a.room


def test_batches_of_one_row_are_shared_through_the_carried_fraction():
    a = HostAssist(0.3, 1)
    rows = 0
    for _ in range(200):
        k = a.take(1, agent_holds=2, host_queued=0, workers=1)
        rows += k
        a.done(k)  # the host keeps up: the share climbs to its top
    assert a.share == HIGH
    assert 0.8 * 200 < rows <= 200


def test_a_new_call_forgets_the_rows_an_abandoned_call_left_unfinished():
    a = HostAssist(0.5, 8)
    for _ in range(3):
        a.take(8, 16, 0, 100)
    assert a.outstanding > 0
    share = a.share
    a.begin_call()
    assert a.outstanding == 0 and a.share == share
    assert a.take(8, 16, 0, 100) > 0
