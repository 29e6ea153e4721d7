"""Put on PYTHONPATH by tests/rdma/vm.py, so that every Python process of a guest run (the agent
started by the split test, too) knows `rdma://` until the transport registry lists it."""

import contextlib

with contextlib.suppress(ImportError, ValueError):
    from nicoffload.transport import register_scheme

    register_scheme("rdma", "nicoffload.transport.rdma")
