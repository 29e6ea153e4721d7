"""The simulator's host assist shares a batch's rows as the runtime's controller does."""

from __future__ import annotations

from nicoffload.fleet.sim import ASSIST_ROOM, Assist
from nicoffload.planner.assist import SHARE_MAX


def test_an_agent_that_is_not_busy_takes_the_batch_whole() -> None:
    assert Assist(0.5, 64).rows(64, agent_busy=False) == 0


def test_an_idle_host_takes_a_step_more_than_the_plans_share() -> None:
    a = Assist(0.5, 64)
    assert a.rows(64, agent_busy=True) == round(0.55 * 64)


def test_a_host_that_falls_behind_takes_a_step_less() -> None:
    a = Assist(0.5, 64)
    a.rows(64, agent_busy=True)  # 35 rows outstanding, more than the next batch's share
    assert a.rows(40, agent_busy=True) == round(0.5 * 40)


def test_the_share_never_passes_its_ceiling() -> None:
    a = Assist(SHARE_MAX, 64)
    assert a.rows(64, agent_busy=True) == round(SHARE_MAX * 64)


def test_no_more_than_room_batches_rows_are_assisted_at_once() -> None:
    a = Assist(0.9, 10)
    taken = [a.rows(10, agent_busy=True) for _ in range(2 * ASSIST_ROOM)]
    assert sum(taken) == ASSIST_ROOM * 10
