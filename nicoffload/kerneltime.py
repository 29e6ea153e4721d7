"""Timing a kernel the way a run executes it, for `nicoffload profile`: every worker of the device
busy at once, each item in its own input and output buffers, and each worker's CPU time per call
(what a core spends on the kernel, which is what the planner's core-ms per item predicts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Items each profiling worker goes round, each with its own input and output buffers: more than
# a core's L2 cache holds, as the items of a run's batch are (a kernel never finds them cached).
RING = 16


def _own(value: Any) -> Any:
    """A buffer of its own holding `value` (a run's items never share one)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(bytearray(value))
    return value


def busy_ms(
    fn,
    variants: list[list[Any]],
    specs: list,
    threads: int,
    budget_s: float,
    clock: Callable[[], float] | None = None,
) -> float:
    """CPU ms per call of `fn` while `threads` workers call it at once, as a run keeps every
    worker busy: each worker goes round its own RING items (the variants' inputs, copied) and,
    when every output is static, writes each result into the item's own destination, as a run
    writes into batch-slot rows; the median over 5 rounds of every worker's CPU time per call
    (the thread's CPU clock: what a core spends, not time spent descheduled). `clock` replaces
    that clock (a GPU kernel's cost is not the calling thread's CPU time: time.perf_counter)."""
    import statistics
    import threading
    import time

    clock = clock or time.thread_time

    import numpy as np

    barrier = threading.Barrier(threads)
    per_call: list[float] = []
    failed: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            args = [[_own(v) for v in variants[j % len(variants)]] for j in range(RING)]
            outs: list[Any] = [None] * RING
            if all(s.static for s in specs):
                rows = [[np.ones(s.shape, s.dtype) for s in specs] for _ in range(RING)]
                outs = [r[0] if len(r) == 1 else tuple(r) for r in rows]
            for j in range(RING):  # warm-up: scratch buffers, first touch of every page
                fn(*args[j], out=outs[j])
            c0 = clock()
            fn(*args[0], out=outs[0])
            once = max(clock() - c0, 1e-6)
            calls = max(RING, int(budget_s / 5 / once))
            mine = []
            for _ in range(5):
                barrier.wait()
                c0 = clock()
                for j in range(calls):
                    fn(*args[j % RING], out=outs[j % RING])
                mine.append((clock() - c0) / calls * 1e3)
            with lock:
                per_call.extend(mine)
        except BaseException as exc:
            failed.append(exc)
            barrier.abort()

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if failed:
        raise failed[0]
    return statistics.median(per_call)
