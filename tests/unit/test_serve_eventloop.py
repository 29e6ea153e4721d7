"""The event loop of serve's fronts and loadgen's processes (`nicoffload.serve.eventloop`):
asyncio's unless NICOFFLOAD_EVENT_LOOP names another, uvloop for `auto` where it imports, and
a clear error for a wrong name or a uvloop asked for and missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from nicoffload.errors import MissingDependency, UserError
from nicoffload.serve import eventloop


async def running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_unset_is_asyncio_even_where_uvloop_imports(monkeypatch):
    monkeypatch.delenv(eventloop.ENV, raising=False)
    assert eventloop.chosen() == "asyncio"
    assert eventloop.run(running_loop_module()).startswith("asyncio")


def test_uvloop_runs_when_asked_for(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.setenv(eventloop.ENV, "uvloop")
    assert eventloop.chosen() == "uvloop"
    assert eventloop.run(running_loop_module()).startswith("uvloop")


def test_auto_is_uvloop_where_it_imports(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.setenv(eventloop.ENV, "auto")
    assert eventloop.chosen() == "uvloop"


def test_auto_is_asyncio_without_uvloop(monkeypatch):
    monkeypatch.setenv(eventloop.ENV, "auto")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop: ImportError
    assert eventloop.chosen() == "asyncio"
    assert eventloop.run(running_loop_module()).startswith("asyncio")


def test_uvloop_asked_for_and_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)
    with pytest.raises(MissingDependency, match=r"nicoffload\[fast\]"):
        eventloop.chosen("uvloop")


def test_an_unknown_loop_name_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(eventloop.ENV, "tokio")
    with pytest.raises(UserError, match="'tokio': one of auto, uvloop, asyncio"):
        eventloop.chosen()
