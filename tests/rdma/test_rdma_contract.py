"""The shared transport contract (tests/unit/test_transport_contract.py), run over rdma:// on real
verbs. Its tests are imported as they are; only `kind` and the addresses it listens on change."""

from __future__ import annotations

import pytest

import tests.unit.test_transport_contract as contract
from tests.unit.test_transport_contract import *  # noqa: F403 (the contract's tests and fixtures)

# Not about a transport's behaviour (or about the socket framing of shm/tcp only).
for _name in (
    "test_a_malformed_frame_fails_recv_and_closes_the_connection",
    "test_an_unknown_scheme_is_refused_with_the_known_ones",
    "test_a_scheme_is_registered_once",
    "test_a_ring_that_the_header_cannot_address_is_refused",
):
    globals().pop(_name, None)


@pytest.fixture(params=["rdma"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _rdma_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract, "address", lambda kind: "rdma://127.0.0.1:0")
