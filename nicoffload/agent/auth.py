"""Shared-secret authentication by HMAC challenge-response; the secret never crosses the wire.

Both sides prove knowledge of the token: the agent sends a nonce, the client answers with its own
nonce and a MAC over both, and the agent answers with a MAC in the other direction (so a client
never loads stages into an impostor either). Both then derive the session's keys (`session_keys`):
one per direction for the MAC every later frame carries, and one for the stage's receiver.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import NamedTuple

from nicoffload.errors import AgentError, Mark, UserError
from nicoffload.transport.integrity import KEY_BYTES, hkdf

NONCE_BYTES = 32
MIN_TOKEN_BYTES = 32
MIN_DISTINCT = 8  # fewer different characters than this is no secret ("aaaa...", "abab...")
MAX_TOKEN_FILE = 4096
_CLIENT = b"nicoffload-agent/1 client"
_SERVER = b"nicoffload-agent/1 server"
_SESSION = b"nicoffload-agent/1 session keys "


def read_token(path: str | Path) -> bytes:
    """The secret in a token file, opened once and checked on its descriptor: a regular file
    (not a link, FIFO or device, which could hang or change), this process's own, readable by
    no one else, whose content is as long as its size says (not a pseudo-file of /proc or /sys),
    holding at least MIN_TOKEN_BYTES of a token that is not one repeated pattern."""
    mark = Mark(str(path), 1, 1)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(
                "the token file is a symbolic link; name the file itself", mark
            ) from None
        raise UserError(f"cannot read the token file: {exc.strerror}", mark) from None
    try:
        st = os.fstat(fd)
        _check_token_file(st, mark)
        data = os.read(fd, MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise UserError(f"cannot read the token file: {exc.strerror}", mark) from None
    finally:
        os.close(fd)
    token = data.strip()
    if len(data) > MAX_TOKEN_FILE:
        raise UserError(f"the token file is more than {MAX_TOKEN_FILE} bytes", mark)
    if len(data) != st.st_size:  # /proc/self/environ passes every other check, as its owner
        raise UserError(
            f"the token file's size is {st.st_size} bytes but {len(data)} were read: a "
            "pseudo-file (/proc, /sys) or one being written; name a file made for the token",
            mark,
        )
    if len(token) < MIN_TOKEN_BYTES:
        raise UserError(
            f"the token must be at least {MIN_TOKEN_BYTES} bytes, got {len(token)} "
            "(make one with `openssl rand -hex 32`)",
            mark,
        )
    if len(set(token)) < MIN_DISTINCT:
        raise UserError(
            f"the token has only {len(set(token))} different characters: not a secret "
            "(make one with `openssl rand -hex 32`)",
            mark,
        )
    return token


def _check_token_file(st: os.stat_result, mark: Mark) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a device"
        )
        raise UserError(f"the token file is {kind}, not a regular file", mark)
    if st.st_uid != os.geteuid():
        raise UserError(
            f"the token file is owned by uid {st.st_uid}, not by this process's ({os.geteuid()})",
            mark,
        )
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(
            f"the token file is open to others (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it",
            mark,
        )


def write_token(path: str | Path) -> bytes:
    """Create a fresh random token file, mode 600 (for local agents and tests)."""
    token = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(token + b"\n")
    return token


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, _CLIENT + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, _SERVER + client_nonce + server_nonce, hashlib.sha256).digest()


class SessionKeys(NamedTuple):
    """What a connection's handshake leaves both sides with (`session_keys`)."""

    client: bytes  # the MAC key of the client's frames
    agent: bytes  # the MAC key of the agent's frames
    forward: bytes  # the key of the receiver the stage forwards to (`transport.listen(key=)`)


def session_keys(
    token: bytes, server_nonce: bytes, client_nonce: bytes, transcript: bytes
) -> SessionKeys:
    """HKDF-SHA256 of the token, salted with both nonces and bound to the handshake's
    transcript (the SHA-256 of its four frames as they went on the wire): a relay that alters
    any of them leaves the two sides with different keys, and a recorded session's keys are
    no use in another (the agent's nonce is new each time)."""
    okm = hkdf(token, server_nonce + client_nonce, _SESSION + transcript, 3 * KEY_BYTES)
    return SessionKeys(okm[:KEY_BYTES], okm[KEY_BYTES : 2 * KEY_BYTES], okm[2 * KEY_BYTES :])


def check(expected: bytes, got: bytes, who: str) -> None:
    """Constant-time comparison; a mismatch is an AgentError naming who failed to prove it."""
    if not isinstance(got, bytes) or not hmac.compare_digest(expected, got):
        raise AgentError(f"authentication failed: the {who} does not hold the token")
