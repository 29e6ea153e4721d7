"""The metrics endpoint's configuration: loopback unless the operator opts in, a token file of
its own, and its limits checked like the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agents.config import AgentConfig, is_loopback, load_config
from nicoffload.errors import UserError


@pytest.mark.parametrize("where", ["0.0.0.0:9470", "[::]:9470", "10.0.0.7:9470", "dpu:9470"])
def test_metrics_off_loopback_are_refused_without_the_opt_in(where: str) -> None:
    with pytest.raises(UserError, match=r"not a loopback address.*metrics_remote = true"):
        AgentConfig().replace(metrics=where)
    assert AgentConfig().replace(metrics=where, metrics_remote=True).metrics == where


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "localhost"])
def test_loopback_addresses_need_no_opt_in(host: str) -> None:
    assert is_loopback(host)
    shown = f"[{host}]" if ":" in host else host
    assert AgentConfig().replace(metrics=f"{shown}:9470").metrics_remote is False


def test_the_opt_in_is_a_boolean_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('metrics = "0.0.0.0:9470"\nmetrics_remote = true\n')
    assert load_config(path).metrics_remote is True
    path.write_text('metrics_remote = "yes"\n')
    with pytest.raises(UserError, match="'metrics_remote' must be of type bool"):
        load_config(path)
    path.write_text("max_handshakes = true\n")
    with pytest.raises(UserError, match="'max_handshakes' must be of type int"):
        load_config(path)


@pytest.mark.parametrize(
    "key", ["metrics_max_connections", "max_handshakes", "max_handshakes_per_address"]
)
def test_the_new_limits_must_be_at_least_1(key: str) -> None:
    with pytest.raises(UserError, match=f"'{key}' must be at least 1"):
        AgentConfig().replace(**{key: 0})
