"""Shared-secret authentication by HMAC challenge-response; the secret never crosses the wire.

Both sides prove knowledge of the token: the agent sends a nonce, the client answers with its own
nonce and a MAC over both, and the agent answers with a MAC in the other direction (so a client
never loads stages into an impostor either).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from nicoffload.errors import AgentError, Mark, UserError

NONCE_BYTES = 32
MIN_TOKEN_BYTES = 16
_CLIENT = b"nicoffload-agent/1 client"
_SERVER = b"nicoffload-agent/1 server"


def read_token(path: str | Path) -> bytes:
    """The secret in a token file; refuse one that is short or readable by others."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        token = p.read_bytes().strip()
    except OSError as exc:
        raise UserError(f"cannot read the token file: {exc.strerror}", Mark(str(p), 1, 1)) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(
            f"the token file is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it",
            Mark(str(p), 1, 1),
        )
    if len(token) < MIN_TOKEN_BYTES:
        raise UserError(f"the token must be at least {MIN_TOKEN_BYTES} bytes", Mark(str(p), 1, 1))
    return token


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


def check(expected: bytes, got: bytes, who: str) -> None:
    """Constant-time comparison; a mismatch is an AgentError naming who failed to prove it."""
    if not isinstance(got, bytes) or not hmac.compare_digest(expected, got):
        raise AgentError(f"authentication failed: the {who} does not hold the token")
