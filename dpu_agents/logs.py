"""Structured logs: one JSON object per line on stderr, `event` naming what happened.

log_event(log, logging.WARNING, "auth_refused", peer="10.0.0.7:5512", reason="wrong token")
-> {"ts": 1718000000.123, "level": "warning", "event": "auth_refused", "peer": ..., ...}

Events that an unauthenticated peer can cause at will go through a Tally: counted, not one line
each.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import Counter
from typing import Any


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    logger.log(level, event, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(level: str = "info") -> None:
    """Route the root logger to stderr as JSON lines (the daemon's only log sink)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime


class Tally:
    """One event that may come in floods (refused logins, failed accepts), logged as a count:
    the first occurrence after a quiet spell at once, then at most one line every `every_s`
    with how many, why (at most MAX_KEYS reasons) and from where (the MAX_KEYS busiest
    addresses of at most MAX_ADDRESSES counted), so a flood costs a line per interval."""

    MAX_KEYS = 8
    MAX_ADDRESSES = 1024

    def __init__(
        self,
        logger: logging.Logger,
        event: str,
        every_s: float = 10.0,
        level: int = logging.WARNING,
        clock: Any = time.monotonic,
    ) -> None:
        self.logger, self.event, self.every_s, self.level = logger, event, every_s, level
        self._clock = clock
        self._lock = threading.Lock()
        self._last = -float("inf")  # when a line was last written
        self._reasons: Counter[str] = Counter()
        self._addresses: Counter[str] = Counter()
        self._only: dict[str, str] = {}  # the last occurrence, written as it is if alone

    def note(self, reason: str, peer: str = "") -> None:
        """One occurrence, from `peer` ("host:port"; counted by host)."""
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        address = peer.rpartition(":")[0] or peer
        with self._lock:
            if len(self._reasons) < self.MAX_KEYS or reason in self._reasons:
                self._reasons[reason] += 1
            else:
                self._reasons["(other reasons)"] += 1
            if address and (
                len(self._addresses) < self.MAX_ADDRESSES or address in self._addresses
            ):
                self._addresses[address] += 1
            self._only = {"reason": reason, "peer": peer} if peer else {"reason": reason}
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Write the line that is due (or, with `force`, whatever is counted): one occurrence
        as it is, more as counts."""
        with self._lock:
            now = self._clock()
            count = sum(self._reasons.values())
            if not count or (not force and now - self._last < self.every_s):
                return
            if count == 1:
                fields: dict[str, Any] = dict(self._only)
            else:
                fields = {"count": count, "reasons": dict(self._reasons.most_common())}
                fields["addresses"] = dict(self._addresses.most_common(self.MAX_KEYS))
                fields["distinct_addresses"] = len(self._addresses)
                if self._last > -float("inf"):
                    fields["seconds"] = round(now - self._last, 3)
            self._reasons.clear()
            self._addresses.clear()
            self._last = now
        log_event(self.logger, self.level, self.event, **fields)
