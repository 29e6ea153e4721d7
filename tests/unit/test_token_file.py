"""The token file is opened once (no link followed, nothing that can block) and checked on that
descriptor: a regular file of this user, private, holding a token of at least 32 bytes that is
not one character repeated. Every refusal is a UserError naming the file."""

from __future__ import annotations

import os
import threading

import pytest

from nicoffload.agent import auth
from nicoffload.errors import UserError

GOOD = b"0f3a9c1e7b5d2864a0c9e1f3b7d5a2c4"  # 32 bytes, 16 different characters


def token_file(tmp_path, content: bytes = GOOD, mode: int = 0o600):
    path = tmp_path / "agent.token"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def refused(path) -> str:
    with pytest.raises(UserError) as info:
        auth.read_token(path)
    assert info.value.mark is not None and info.value.mark.file == str(path)
    return info.value.message


def test_a_good_token_is_read_whitespace_stripped(tmp_path) -> None:
    assert auth.read_token(token_file(tmp_path, GOOD + b"\n")) == GOOD


def test_a_fifo_is_refused_at_once_instead_of_blocking(tmp_path) -> None:
    path = tmp_path / "fifo.token"
    os.mkfifo(path, 0o600)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(refused(path)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO token path blocked"
    assert got == ["the token file is a FIFO, not a regular file"]


def test_a_symbolic_link_is_refused_even_to_a_good_file(tmp_path) -> None:
    link = tmp_path / "link.token"
    link.symlink_to(token_file(tmp_path))
    assert refused(link) == "the token file is a symbolic link; name the file itself"


def test_a_directory_is_refused(tmp_path) -> None:
    folder = tmp_path / "dir.token"
    folder.mkdir(mode=0o700)
    assert refused(folder) == "the token file is a directory, not a regular file"


def test_a_file_owned_by_another_user_is_refused(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = token_file(tmp_path)
    os.chown(path, os.geteuid() + 4242, -1)
    assert refused(path).startswith(f"the token file is owned by uid {os.geteuid() + 4242},")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_file_others_may_touch_is_refused(tmp_path, mode: int) -> None:
    assert refused(token_file(tmp_path, mode=mode)) == (
        f"the token file is open to others (mode {mode:o}); chmod 600 it"
    )


def test_a_token_of_31_bytes_is_refused_and_32_accepted(tmp_path) -> None:
    assert refused(token_file(tmp_path, GOOD[:31])).startswith(
        "the token must be at least 32 bytes, got 31"
    )
    assert auth.read_token(token_file(tmp_path, GOOD)) == GOOD


@pytest.mark.parametrize("token", [b"a" * 64, b"ab" * 32, b"0123456" * 6])
def test_a_token_of_a_few_repeated_characters_is_refused(tmp_path, token: bytes) -> None:
    assert "different characters: not a secret" in refused(token_file(tmp_path, token))


def test_write_token_makes_a_file_read_token_accepts(tmp_path) -> None:
    path = tmp_path / "fresh.token"
    token = auth.write_token(path)
    assert auth.read_token(path) == token
