"""Structured logs: one JSON object per line on stderr, `event` naming what happened.

log_event(log, logging.WARNING, "auth_refused", peer="10.0.0.7:5512", reason="wrong token")
-> {"ts": 1718000000.123, "level": "warning", "event": "auth_refused", "peer": ..., ...}
"""

from __future__ import annotations

import json
import logging
import sys
import time
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
