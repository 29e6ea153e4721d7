"""A token file must be an ordinary file: a pseudo-file of /proc passes the type, owner and mode
checks (this process's /proc/self/environ is a 'regular' file of its user, mode 400, with
plenty of different characters) and was taken as the token."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nicoffload.agent import auth
from nicoffload.errors import UserError


def test_a_proc_pseudo_file_is_refused_as_token_file() -> None:
    environ = Path("/proc/self/environ")
    if not environ.exists() or os.stat(environ).st_uid != os.geteuid():
        pytest.skip("no /proc of this process's own here")
    assert len(set(environ.read_bytes())) >= 8  # it would pass the token's own checks
    with pytest.raises(UserError, match=r"pseudo-file \(/proc, /sys\)"):
        auth.read_token(environ)


def test_an_ordinary_token_file_is_still_read(tmp_path: Path) -> None:
    auth.write_token(tmp_path / "token")
    assert len(auth.read_token(tmp_path / "token")) >= auth.MIN_TOKEN_BYTES
