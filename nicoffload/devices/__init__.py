"""Devices: what each kind of device is (its allocator, streams, staging memory, availability).

One module per kind (`gpu.py`, ...), imported by name on first use, so that `import nicoffload`
never imports CUDA, verbs or other heavy libraries (tinygrad's habit).
"""

from __future__ import annotations

import importlib
from types import ModuleType

KINDS = ("cpu", "dpu", "gpu")


def load(kind: str) -> ModuleType:
    """The module that describes a device kind, imported now (its own imports stay lazy)."""
    if kind not in KINDS:
        raise KeyError(f"unknown device kind '{kind}'; known: {', '.join(KINDS)}")
    return importlib.import_module(f"nicoffload.devices.{kind}")
