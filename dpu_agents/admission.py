"""Who may hold a connection to the agent: handshakes and sessions in separate pools.

A connection is a *handshake* from accept until it proves the token, then a *session*. The
handshake pool is small and an address may hold at most `per_address` of it. A new connection is
never refused: when its address holds its share, its own oldest handshake makes room; when the
pool is full, the oldest handshake of the busiest address does; either way one that has not yet
said HELLO goes before one that has. So idle or dribbling sockets can never keep a client out,
and strangers churning connections displace each other, not a client from another address
(unless they hold at most one handshake per address, over `limit` addresses). Sessions have their own pool, which only clients holding the token can fill.
Bookkeeping only: the agent stops what is displaced or expired.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable


class Admission:
    """Thread-safe pools of connections (any hashable), handshakes kept in arrival order."""

    GONE = "displaced or expired before it authenticated"

    def __init__(
        self,
        limit: int,
        per_address: int,
        sessions: int,
        deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit, self.per_address, self.max_sessions = limit, per_address, sessions
        self.deadline_s, self._clock = deadline_s, clock
        self._lock = threading.Lock()
        self._pending: dict[Hashable, tuple[str, float]] = {}  # conn -> (address, since)
        self._by_address: Counter[str] = Counter()
        self._greeted: set[Hashable] = set()
        self._sessions: set[Hashable] = set()

    def admit(self, conn: Hashable, address: str, greeted: bool = False) -> list[Hashable]:
        """Take `conn` as a handshake from `address` (`greeted`: its HELLO is already there);
        returns the handshakes it displaced."""
        with self._lock:
            out = []
            if self._by_address[address] >= self.per_address:
                out.append(self._victim(lambda a: a == address))
            elif len(self._pending) >= self.limit:
                most = max(self._by_address.values())
                out.append(self._victim(lambda a: self._by_address[a] == most))
            for c in out:
                self._drop(c)
            self._pending[conn] = (address, self._clock())
            self._by_address[address] += 1
            if greeted:
                self._greeted.add(conn)
            return out

    def greeted(self, conn: Hashable) -> None:
        """`conn` sent a well-formed HELLO: displace it only after those that have not."""
        with self._lock:
            if conn in self._pending:
                self._greeted.add(conn)

    def _victim(self, fits: Callable[[str], bool]) -> Hashable:
        """The oldest handshake from an address that `fits` that has not said HELLO (a client
        says it as it connects), else the oldest from such an address."""
        oldest = None
        for c, (a, _) in self._pending.items():
            if fits(a):
                if c not in self._greeted:
                    return c
                oldest = c if oldest is None else oldest
        assert oldest is not None
        return oldest

    def promote(self, conn: Hashable) -> str:
        """`conn` proved the token: move it to the sessions. Returns "" when done, else why not
        (then `conn` is forgotten): the session pool is full, or `conn` was displaced or
        expired meanwhile."""
        with self._lock:
            if conn not in self._pending:
                return self.GONE
            self._drop(conn)
            if len(self._sessions) >= self.max_sessions:
                return f"too many connections ({self.max_sessions} sessions)"
            self._sessions.add(conn)
            return ""

    def expired(self) -> list[Hashable]:
        """Forget and return the handshakes older than the deadline."""
        cutoff = self._clock() - self.deadline_s
        with self._lock:
            out = []
            for c, (_, since) in self._pending.items():  # oldest first
                if since > cutoff:
                    break
                out.append(c)
            for c in out:
                self._drop(c)
            return out

    def forget(self, conn: Hashable) -> None:
        with self._lock:
            if conn in self._pending:
                self._drop(conn)
            self._sessions.discard(conn)

    def counts(self) -> tuple[int, int]:
        """(handshakes, sessions) now."""
        with self._lock:
            return len(self._pending), len(self._sessions)

    def all(self) -> list[Hashable]:
        with self._lock:
            return [*self._pending, *self._sessions]

    def sessions(self) -> list[Hashable]:
        with self._lock:
            return list(self._sessions)

    def _drop(self, conn: Hashable) -> None:
        address, _ = self._pending.pop(conn)
        self._greeted.discard(conn)
        self._by_address[address] -= 1
        if not self._by_address[address]:
            del self._by_address[address]
