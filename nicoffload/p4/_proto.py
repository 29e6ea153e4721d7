"""The `p4runtime` package's protobuf modules, imported on first use.

p4runtime's generated `_pb2` modules predate protobuf 4 and load only with protobuf's pure-Python
implementation, so that implementation is chosen here unless protobuf was imported already.
"""

from __future__ import annotations

import functools
import os
import sys
from types import SimpleNamespace

from nicoffload.errors import MissingDependency, SystemFailure


@functools.cache
def proto() -> SimpleNamespace:
    """p4runtime_pb2, p4info_pb2, text_format and json_format, as attributes of one namespace."""
    if "google.protobuf" not in sys.modules:
        os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
    try:
        from google.protobuf import json_format, text_format
        from p4.config.v1 import p4info_pb2
        from p4.v1 import p4runtime_pb2
    except ImportError as exc:
        raise MissingDependency("p4runtime", "p4", "writing P4Runtime entries") from exc
    except TypeError as exc:  # "Descriptors cannot be created directly": upb loaded first
        raise SystemFailure(
            "p4runtime: its generated protobufs need protobuf's pure-Python implementation; "
            "set PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python before anything imports protobuf"
        ) from exc
    return SimpleNamespace(
        p4runtime_pb2=p4runtime_pb2,
        p4info_pb2=p4info_pb2,
        text_format=text_format,
        json_format=json_format,
    )
