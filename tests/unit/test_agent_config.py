"""The agent's configuration: the example file is valid, mistakes name the file and key, flags
override the file, and the command line refuses to start without a usable token (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_agents.config import AgentConfig, load_config
from dpu_agents.server import main
from nicoffload.errors import UserError

EXAMPLE = Path(__file__).resolve().parents[2] / "dpu_agents" / "agent.example.toml"


def test_the_example_config_is_valid_and_listens_on_loopback() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.listen.startswith("127.0.0.1:")
    assert AgentConfig().listen.startswith("127.0.0.1:")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cores = 'two'", "'cores' must be of type int"),
        ("windw = 4", "unknown key 'windw' (did you mean 'window'?)"),
        ("listen = 'nohost'", "'listen' must be HOST:PORT"),
        ("io_timeout_s = 0", "'io_timeout_s' must be positive"),
        ("listen = ", "not valid TOML"),
    ],
)
def test_a_config_mistake_names_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text + "\n")
    with pytest.raises(UserError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:1:1: ") and message in str(info.value)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("[agent]\ncores = 2\nwindow = 32\n")
    cfg = load_config(path).replace(cores=1, listen=None)
    assert (cfg.cores, cfg.window, cfg.listen) == (1, 32, AgentConfig().listen)


def test_the_agent_does_not_start_without_a_token(tmp_path: Path, capsys) -> None:
    assert main(["--listen", "127.0.0.1:0"]) == 2
    assert "no token file" in capsys.readouterr().err
    assert main(["--listen", "127.0.0.1:0", "--token-file", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "cannot read the token file" in err
    assert not any(line.startswith("{") for line in err.splitlines())  # a message, no traceback
