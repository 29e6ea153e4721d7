"""The RDMA tests run against real verbs (Soft-RoCE in the guest `vm.py` boots); elsewhere they
skip, saying why."""

from __future__ import annotations

import pytest

from nicoffload.errors import DeviceError
from nicoffload.transport import verbs


def verbs_missing() -> str | None:
    """Why the rdma tests cannot run here, or None."""
    try:
        found = verbs.devices()
    except DeviceError as exc:
        return str(exc)
    return None if found else "no RDMA device here (make test-rdma runs these in a Soft-RoCE guest)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = verbs_missing()
    if reason:
        for item in items:
            if "tests/rdma" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))
