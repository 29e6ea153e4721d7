"""The agent's measurements: Prometheus metrics in the agent's own registry (served by
`--metrics HOST:PORT`), and the same numbers as a plain dict for the STATS reply.

Stage names come from clients: as label values they are bounded in length (LOAD refuses a name
that is not `[A-Za-z0-9_.@-]{1,64}`) and in number: past `max_labels` stages (and as many
queues), the series of the one updated least recently is removed for the new one, so labels of
closed sessions go first and a stream of new names cannot grow the registry.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from nicoffload.errors import MissingDependency

try:
    from prometheus_client import CollectorRegistry, Gauge, Histogram
    from prometheus_client import Counter as PromCounter
except ImportError as exc:  # the agent's extra
    raise MissingDependency("prometheus-client", "agent", "the DPU agent") from exc

# Per-item stage time: from tens of microseconds (a crop) to a second (a huge decode).
STAGE_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
MAX_LABELS = 128  # stage labels kept (and queue labels): twice the default max_connections
MAX_LABEL_CHARS = 64


class _Labels:
    """Label values in the order of their last use; `use` returns the value to record under
    after evicting (`drop`) the least recently used one when a new value would pass `limit`."""

    def __init__(self, limit: int, drop: Callable[[str], None]) -> None:
        self.limit, self._drop = limit, drop
        self._order: OrderedDict[str, None] = OrderedDict()

    def use(self, value: str) -> str:
        value = value[:MAX_LABEL_CHARS]
        if value in self._order:
            self._order.move_to_end(value)
            return value
        while len(self._order) >= self.limit:
            self._drop(self._order.popitem(last=False)[0])
        self._order[value] = None
        return value


class Metrics:
    """Counters the agent updates; `snapshot()` is the STATS document."""

    def __init__(self, max_labels: int = MAX_LABELS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = PromCounter(
            "nicoffload_agent_requests", "Requests admitted at the ingress", registry=r
        )
        self._duplicates = PromCounter(
            "nicoffload_agent_duplicate_requests", "Requests dropped as duplicates", registry=r
        )
        self._errors = PromCounter(
            "nicoffload_agent_errors", "Errors by reason", ["reason"], registry=r
        )
        self._items = PromCounter(
            "nicoffload_agent_items", "Items processed, by outcome", ["outcome"], registry=r
        )
        self._batches = PromCounter(
            "nicoffload_agent_batches", "Batches forwarded to the next placement", registry=r
        )
        self._bytes = PromCounter(
            "nicoffload_agent_bytes", "Bytes moved", ["direction"], registry=r
        )
        self._stage = Histogram(
            "nicoffload_agent_stage_seconds",
            "Time of one item in a stage",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self._queue = Gauge("nicoffload_agent_queue_depth", "Items waiting", ["queue"], registry=r)
        self._connections = Gauge(
            "nicoffload_agent_connections", "Open client connections", registry=r
        )
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._reasons: Counter[str] = Counter()
        self._stage_s: Counter[str] = Counter()
        self._stage_n: Counter[str] = Counter()
        self._depth: dict[str, int] = {}
        self._stages = _Labels(max_labels, self._drop_stage)
        self._queues = _Labels(max_labels, self._drop_queue)

    def _drop_stage(self, stage: str) -> None:  # under self._lock
        with contextlib.suppress(KeyError):
            self._stage.remove(stage)
        self._stage_s.pop(stage, None)
        self._stage_n.pop(stage, None)

    def _drop_queue(self, queue: str) -> None:  # under self._lock
        with contextlib.suppress(KeyError):
            self._queue.remove(queue)
        self._depth.pop(queue, None)

    def request(self, nbytes: int, items: int = 1) -> None:
        """A REQUEST frame of `items` requests, `nbytes` in all."""
        self._requests.inc(items)
        self._bytes.labels("in").inc(nbytes)
        with self._lock:
            self._counts["requests"] += items
            self._counts["bytes_in"] += nbytes

    def duplicate(self) -> None:
        self._duplicates.inc()
        with self._lock:
            self._counts["duplicates"] += 1

    def error(self, reason: str) -> None:
        self._errors.labels(reason).inc()
        with self._lock:
            self._reasons[reason] += 1

    def item(self, stage: str, seconds: float, ok: bool) -> None:
        self.items(stage, [seconds], 0 if ok else 1)

    def items(self, stage: str, seconds: list[float], failed: int) -> None:
        """Items run in a stage (their times), `failed` of them failed: recorded at once (a
        worker's share of a batch), one lock and one label lookup, not one of each an item."""
        n = len(seconds)
        if n > failed:
            self._items.labels("ok").inc(n - failed)
        if failed:
            self._items.labels("failed").inc(failed)
        with self._lock:
            stage = self._stages.use(stage)
            observe = self._stage.labels(stage).observe
            for t in seconds:
                observe(t)
            self._stage_s[stage] += sum(seconds)
            self._stage_n[stage] += n
            self._counts["items_ok"] += n - failed
            self._counts["items_failed"] += failed

    def batch(self, nbytes: int) -> None:
        self._batches.inc()
        self._bytes.labels("out").inc(nbytes)
        with self._lock:
            self._counts["batches"] += 1
            self._counts["bytes_out"] += nbytes

    def depth(self, queue: str, n: int) -> None:
        with self._lock:
            queue = self._queues.use(queue)
            self._queue.labels(queue).set(n)
            self._depth[queue] = n

    def connections(self, n: int) -> None:
        self._connections.set(n)
        with self._lock:
            self._counts["connections"] = n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            keys = (
                "requests",
                "duplicates",
                "items_ok",
                "items_failed",
                "batches",
                "bytes_in",
                "bytes_out",
                "connections",
            )
            doc: dict[str, Any] = {k: self._counts[k] for k in keys}
            doc["errors"] = dict(self._reasons)
            doc["queue_depth"] = dict(self._depth)
            doc["stages"] = {
                s: {"items": n, "ms_per_item": round(self._stage_s[s] * 1e3 / n, 4)}
                for s, n in self._stage_n.items()
            }
        return doc
