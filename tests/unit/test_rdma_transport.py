"""rdma:// without verbs: addresses, the handshake's endpoint text, immediates, and the errors a
missing pyverbs or RDMA device gives. The transport itself is tested on real verbs in
tests/rdma (make test-rdma); here those tests skip."""

from __future__ import annotations

import pytest

from nicoffload.errors import DeviceError, TransportError
from nicoffload.transport import rdma, verbs


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("rdma://10.0.0.2:7000", ("10.0.0.2", 7000, None, None)),
        ("rdma://host:1?device=rxe0", ("host", 1, "rxe0", None)),
        ("rdma://[::1]:9", ("::1", 9, None, None)),
        ("rdma://host:1?device=mlx5_0&gpu=1", ("host", 1, "mlx5_0", 1)),
    ],
)
def test_an_rdma_address_names_host_port_and_maybe_the_device(address: str, parsed: tuple) -> None:
    assert rdma.parse(address) == parsed


@pytest.mark.parametrize(
    "address",
    ["rdma://host", "tcp://host:1", "rdma://host:1/x", "rdma://host:1?dev=x", "rdma://h:1?gpu=a"],
)
def test_a_bad_rdma_address_says_the_right_form(address: str) -> None:
    with pytest.raises(TransportError, match=r"expected rdma://HOST:PORT\[\?device=NAME\]"):
        rdma.parse(address)


def test_an_endpoint_survives_the_control_channel() -> None:
    peer = verbs.Peer(qpn=17, psn=0xABCDE, gid="fe80:0000:0000:0000:04cc:75ff:feab:798e", lid=0)
    assert verbs.Peer.decode(peer.encode()) == peer
    with pytest.raises(TransportError, match="malformed rdma endpoint"):
        verbs.Peer.decode("17:x")


@pytest.mark.parametrize("imm", [0, 1, 65535, verbs.IMM_GOODBYE])
def test_an_immediate_goes_to_the_wire_and_back_unchanged(imm: int) -> None:
    assert verbs._imm_host(verbs._imm_wire(imm)) == imm


def test_no_rdma_device_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs, "devices", lambda: [])
    with pytest.raises(DeviceError, match=r"no RDMA device.*rdma link add rxe0 type rxe"):
        verbs.pick_device(None)


def test_a_missing_named_device_lists_those_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs, "devices", lambda: ["rxe0"])
    with pytest.raises(DeviceError, match=r"'mlx5_0' not found \(devices: rxe0\)"):
        verbs.pick_device("mlx5_0")
    assert verbs.pick_device(None) == "rxe0"


def test_listening_without_a_device_fails_before_opening_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verbs, "devices", lambda: [])
    with pytest.raises(DeviceError, match="no RDMA device"):
        rdma.listen("rdma://127.0.0.1:0", slots=1, slot_bytes=64)


def test_a_missing_pyverbs_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import sys

    real_import = builtins.__import__

    def no_pyverbs(name: str, *args: object, **kw: object) -> object:
        if name == "pyverbs" or name.startswith("pyverbs."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kw)

    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_pyverbs)
    monkeypatch.setattr(verbs, "SYSTEM_PYVERBS", "/nonexistent")
    with pytest.raises(DeviceError, match="apt-get install python3-pyverbs"):
        verbs.pyverbs()
