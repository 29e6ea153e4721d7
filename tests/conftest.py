"""Shared fixtures: the repository root and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

# One protobuf implementation per process, chosen when protobuf is first imported: p4runtime's
# generated modules load only under the pure-Python one (nicoffload/p4/_proto.py), while
# tritonclient's gRPC classes load under either. The suite imports both, in whatever order the
# tests run, so it asks for the one both accept before anything imports protobuf.
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session", autouse=True)
def _no_measured_profiles(tmp_path_factory: pytest.TempPathFactory):
    """Tests never read this machine's measured profiles (`nicoffload profile` writes them to
    ~/.cache/nicoffload/profiles): what a plan looks like must not depend on who ran `make run`
    before. A test that needs a measured profile writes one into its own folder."""
    import os

    old = os.environ.get("NICOFFLOAD_PROFILES")
    os.environ["NICOFFLOAD_PROFILES"] = str(tmp_path_factory.mktemp("profiles"))
    yield
    if old is None:
        os.environ.pop("NICOFFLOAD_PROFILES", None)
    else:
        os.environ["NICOFFLOAD_PROFILES"] = old
