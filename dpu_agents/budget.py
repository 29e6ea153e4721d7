"""The agent's memory budget, per client (connection) and over every client, in three pools:
request payloads queued (received, not yet forwarded), images being decoded (their size read
from each header before a pixel is decoded) and LOADs' batch slots; and a fourth, the agent's
own: the worker processes' arenas (`arenas.Arenas`), taken and given back with `Budget.take`.

A reader that would go over its client's share, or the total, waits (it stops reading its
socket: backpressure); only what is larger than a whole pool is refused, by the caller. A holder
of `queued` may wait for `decode`, never the other way round, and what holds `decode` (admitted
items) waits for neither: no wait can close a cycle. Batch slots are taken at LOAD or refused.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nicoffload.errors import TransportError
from nicoffload.ops.decode import decoded_size, image_header

if TYPE_CHECKING:
    from dpu_agents.config import AgentConfig
    from dpu_agents.stagebuild import Built

QUEUED, DECODE, BATCH, ARENA = "queued", "decode", "batch", "arena"
KINDS = (QUEUED, DECODE, BATCH, ARENA)
_CREATE = threading.Lock()  # one Budget per agent, made by its first connection


class Budget:
    """Bytes in use per pool, over every client; `client()` opens one client's account."""

    def __init__(self, config: AgentConfig) -> None:
        self.total = {
            QUEUED: config.queued_bytes,
            DECODE: config.decode_bytes,
            BATCH: config.batch_bytes,
            ARENA: config.arena_bytes,
        }
        self.per_client = {
            QUEUED: config.queued_bytes_per_client,
            DECODE: config.decode_bytes_per_client,
            BATCH: config.batch_bytes,
            ARENA: config.arena_bytes,  # no client's: the agent's (`take`)
        }
        self.arena_most, self.arena_keep = config.max_arena_bytes, config.arena_keep_bytes
        self.used = dict.fromkeys(KINDS, 0)
        self.cond = threading.Condition()
        self.deadlines = Deadlines()

    def take(self, kind: str, n: int) -> bool:
        """Take `n` bytes of `kind` for the agent itself (what no client holds: a worker's
        arena, shared by every session) if they fit the total now; False if not."""
        with self.cond:
            if self.used[kind] + n > self.total[kind]:
                return False
            self.used[kind] += n
            return True

    def give(self, kind: str, n: int) -> None:
        """Give back what `take` took."""
        with self.cond:
            assert 0 <= n <= self.used[kind], (kind, n)
            self.used[kind] -= n
            self.cond.notify_all()

    def client(self) -> Account:
        return Account(self)

    def snapshot(self) -> dict[str, int]:
        with self.cond:
            return dict(self.used)


def shared(agent: Any) -> Budget:
    """The agent's one Budget (made on first use from its config)."""
    with _CREATE:
        budget = getattr(agent, "budget", None)
        if budget is None:
            budget = agent.budget = Budget(agent.config)
        return budget


class Account:
    """One client's share of the Budget. `close()` gives back whatever it still holds."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.used = dict.fromkeys(KINDS, 0)
        self._cancelled = self._closed = False

    def most(self, kind: str) -> int:
        """The largest amount one reservation of `kind` can ever get."""
        return min(self.budget.total[kind], self.budget.per_client[kind])

    def _fits(self, kind: str, n: int) -> bool:
        b = self.budget
        return self.used[kind] + n <= b.per_client[kind] and b.used[kind] + n <= b.total[kind]

    def reserve(self, kind: str, n: int, timeout: float) -> None:
        """Take `n` bytes of `kind`, waiting while they do not fit (n <= most(kind));
        TransportError once cancelled, or after `timeout` s."""
        assert 0 <= n <= self.most(kind), (kind, n)
        deadline = time.monotonic() + timeout
        with self.budget.cond:
            while not self._fits(kind, n):
                left = deadline - time.monotonic()
                if self._cancelled or self._closed or left <= 0:
                    why = "the connection is closing" if left > 0 else f"waited {timeout} s"
                    raise TransportError(f"no {kind} memory budget for {n} bytes: {why}")
                self.budget.cond.wait(left)
            self._take(kind, n)

    def take(self, kind: str, n: int) -> bool:
        """Take `n` bytes of `kind` now if they fit; False if not."""
        with self.budget.cond:
            if self._closed or not self._fits(kind, n):
                return False
            self._take(kind, n)
            return True

    def _take(self, kind: str, n: int) -> None:
        self.used[kind] += n
        self.budget.used[kind] += n

    def release(self, kind: str, n: int) -> None:
        if n <= 0:
            return
        with self.budget.cond:
            n = min(n, self.used[kind])  # after close() nothing is held: nothing to give back
            self.used[kind] -= n
            self.budget.used[kind] -= n
            self.budget.cond.notify_all()

    def cancel(self) -> None:
        """Wake a reader waiting in `reserve` (it raises): the connection is going away."""
        with self.budget.cond:
            self._cancelled = True
            self.budget.cond.notify_all()

    def close(self) -> None:
        with self.budget.cond:
            self._closed = True
            for kind in KINDS:
                self.budget.used[kind] -= self.used[kind]
                self.used[kind] = 0
            self.budget.cond.notify_all()


@dataclass(frozen=True)
class _Decoder:
    input: str  # the pipeline input it reads
    params: Mapping[str, Any]
    consumers: tuple[Any, ...]
    channels: int
    resizes: tuple[tuple[Mapping[str, Any], int], ...]  # (params, itemsize) of resizes after it


def decode_costs(built: Built) -> Callable[[Mapping[str, Any]], int]:
    """`cost(values)`: the bytes the stage's decoders (and the resizes reading them) will hold
    for one request, from each image's header; 0 for what the kernel refuses from its header
    (not an image, over max_pixels). A decoded image the request carries (a tensor input:
    its bytes are the payload's, in `queued`) counts what the resizes reading it hold."""
    from nicoffload.ops import kernel_consumers

    pipeline = built.pipeline
    decoders = []
    images = []  # (tensor input, params and itemsize of a resize in the stage reading it)
    for name in built.stage.plan.nodes:
        node = pipeline.node(name)
        src = str(node.inputs[0]) if node.inputs else ""
        if node.op == "resize" and src in built.inputs:  # a uint8 HWC tensor (its wiring)
            images.append((src, node.params, node.out_specs["out"].itemsize))
        if node.op != "decode_image" or src not in built.inputs:
            continue
        consumers = kernel_consumers(pipeline, name)
        resizes = tuple(
            (c.params, c.out_specs["out"].itemsize)
            for c in consumers
            if getattr(c, "op", "") == "resize" and c.name in built.stage.plan.nodes
        )
        channels = 3 if node.params["color"] == "rgb" else 1
        decoders.append(_Decoder(src, node.params, consumers, channels, resizes))

    memo: dict[tuple[int, Any], int] = {}  # per decoder and header: what it holds

    def held(i: int, d: _Decoder, data: Any) -> int:
        head = image_header(data)
        if head is None:
            return 0
        got = memo.get((i, head))
        if got is None:  # a dataset has few image sizes: decoded_size is Python, per size once
            if len(memo) >= MEMO_SIZES:
                memo.clear()
            got = memo[i, head] = _one(d, head)
        return got

    def cost(values: Mapping[str, Any]) -> int:
        total = 0
        for i, d in enumerate(decoders):
            total += held(i, d, values[d.input])
        for k, p, itemsize in images:
            total += _resized(values[k], p, itemsize)
        return total

    return cost


MEMO_SIZES = 4096  # image headers remembered per stage (a few hundred kB)


def _resized(image: Any, params: Any, itemsize: int) -> int:
    """What a resize of a decoded image the request carries (HWC) holds."""
    from nicoffload.ops.resize import output_size

    h, w, c = image.shape
    return math.prod(output_size(params, h, w)) * c * itemsize


def _one(d: _Decoder, head: tuple[str, int, int, str]) -> int:
    fmt, h, w, space = head
    if h * w > d.params["max_pixels"]:
        return 0
    if fmt == "png":  # Pillow's own image (4 bytes a pixel, 8 for 16-bit), converted, copied
        held = h * w * (8 + 4 + d.channels)
    else:
        sh, sw = decoded_size(d.params, d.consumers, h, w)
        held = sh * sw * (d.channels + (4 if space in ("CMYK", "YCCK") else 0))
    from nicoffload.ops.resize import output_size

    for params, itemsize in d.resizes:
        held += math.prod(output_size(params, h, w)) * d.channels * itemsize
    return held


class Deadlines:
    """Reads that must be done by a time (a request's whole payload): one thread, started on
    first use, calls each late one's `on_late` (which shuts its socket), so a sender that
    trickles a byte now and then cannot hold a reserved buffer for longer."""

    PERIOD_S = 0.1

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self, key: int, deadline: float, on_late: Callable[[], None]) -> None:
        with self._lock:
            self._due[key] = (deadline, on_late)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deadlines", daemon=True)
                self._thread.start()

    def disarm(self, key: int) -> None:
        with self._lock:
            self._due.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.PERIOD_S)
            now = time.monotonic()
            with self._lock:
                late = [k for k, (t, _) in self._due.items() if t <= now]
                calls = [self._due.pop(k)[1] for k in late]
            for call in calls:
                call()
