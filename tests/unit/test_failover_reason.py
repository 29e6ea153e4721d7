"""A call's failover reason: the first reason any item's DPU stage ran on the host, unless the
agent then stopped taking items, whose reason replaces one of single items once (a server that
had one item too large for the transfer, then lost its agent, says it lost its agent)."""

from __future__ import annotations

from types import SimpleNamespace

from nicoffload.runtime.remote import failover_reason

UP, GONE = SimpleNamespace(accepting=True), SimpleNamespace(accepting=False)


def test_the_first_reason_stays_while_the_agent_takes_items():
    said = failover_reason(None, "an item did not fit the transfer", UP)
    assert failover_reason(said, "another item did not fit", UP) == said


def test_the_agents_end_replaces_a_single_items_reason_once():
    said = failover_reason(None, "an item did not fit the transfer", UP)
    said = failover_reason(said, "the agent is draining: shutting down", GONE)
    assert said == ("the agent is draining: shutting down", True)
    assert failover_reason(said, "the agent is gone", GONE) == said


def test_an_agent_gone_from_the_start_is_said_as_it_is():
    assert failover_reason(None, "the agent is gone (started)", GONE)[0] == (
        "the agent is gone (started)"
    )
    assert failover_reason(None, "why", None) == ("why", False)
