"""The event loop of serve's fronts and loadgen's processes: asyncio's own unless
NICOFFLOAD_EVENT_LOOP names another: `uvloop` (libuv, the `fast` extra), `auto` (uvloop where
it imports), `asyncio`. asyncio's is the default because uvloop did not measurably lower a
front's or a load process's CPU per request on the 2-core VM once the answer's copies were
gone (bench/RESULTS.md, "Where a front's CPU goes"): what is left is mostly system calls and
aiohttp's own Python. Whoever runs one says which in what it reports (`event_loop`), so that
a figure is never read as uvloop's when it was asyncio's.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from nicoffload.errors import MissingDependency, UserError

T = TypeVar("T")
ENV = "NICOFFLOAD_EVENT_LOOP"
CHOICES = ("uvloop", "asyncio")


def requested() -> str | None:
    """What NICOFFLOAD_EVENT_LOOP asks for, or None."""
    return os.environ.get(ENV) or None


def chosen(want: str | None = None) -> str:
    """`want` ("auto" or one of CHOICES; None: NICOFFLOAD_EVENT_LOOP's, else "asyncio") as
    the loop that will run: "auto" is uvloop when it imports. Asking for uvloop without it is
    an error that names the extra."""
    want = want or requested() or "asyncio"
    if want not in ("auto", *CHOICES):
        raise UserError(f"{ENV}={want!r}: one of auto, {', '.join(CHOICES)}")
    if want == "asyncio":
        return want
    try:
        import uvloop  # noqa: F401
    except ImportError as exc:
        if want == "uvloop":
            raise MissingDependency("uvloop", "fast", f"{ENV}=uvloop") from exc
        return "asyncio"
    return "uvloop"


def factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A new loop of `name` (one of CHOICES)."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], name: str | None = None) -> T:
    """`asyncio.run(main)` on the loop `chosen(name)` picks (say `chosen()` in what you
    report: it is what ran)."""
    with asyncio.Runner(loop_factory=factory(chosen(name))) as runner:
        return runner.run(main)
