"""A reliable-connected verbs endpoint on pyverbs, for the rdma transport: device, PD, CQs with a
completion channel, an RC QP, memory regions; bounded busy-poll then a blocking wait; verbs
failures mapped to TransportError (with the work-completion status) and torn down in order.

pyverbs is imported on first use. Debian's `python3-pyverbs` is found in its system folder even
from a virtual environment (the PyPI sdist does not load against Debian's rdma-core).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import select
import sys
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from nicoffload.errors import DeviceError, TransportError

SYSTEM_PYVERBS = "/usr/lib/python3/dist-packages/pyverbs"
HOW_TO_GET = (
    "install Debian's python3-pyverbs (apt-get install python3-pyverbs rdma-core), or put a "
    "folder holding a pyverbs built for this Python on PYTHONPATH"
)
SPIN_S = 50e-6  # busy-poll this long before sleeping on the completion channel
IMM_GOODBYE = 0xFFFFFFFF  # an immediate no slot can have: the peer closes
QP_TIMEOUT = 14  # 4.096 us x 2^14 = 67 ms per retry; 7 retries: a dead peer shows in ~0.5 s
RETRIES = 7
_create_lock = threading.Lock()  # fd discovery of a new completion channel (see _new_fd)


@dataclass(frozen=True)
class Peer:
    """What one end of an RC connection tells the other over the control channel."""

    qpn: int
    psn: int
    gid: str
    lid: int = 0

    def encode(self) -> str:
        return f"{self.qpn}:{self.psn}:{self.gid}:{self.lid}"

    @classmethod
    def decode(cls, text: str) -> Peer:
        try:
            qpn, psn, rest = text.split(":", 2)
            gid, lid = rest.rsplit(":", 1)
            return cls(int(qpn), int(psn), gid, int(lid))
        except ValueError:
            raise TransportError(f"malformed rdma endpoint {text!r}") from None


def pyverbs() -> ModuleType:
    """The pyverbs package, imported now; DeviceError saying how to get it when it is absent."""
    if "pyverbs" in sys.modules:
        return sys.modules["pyverbs"]
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    init = os.path.join(SYSTEM_PYVERBS, "__init__.py")
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    if os.path.exists(init) and any(tag in n for n in os.listdir(SYSTEM_PYVERBS)):
        spec = importlib.util.spec_from_file_location(
            "pyverbs", init, submodule_search_locations=[SYSTEM_PYVERBS]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
            importlib.import_module("pyverbs.device")
        except ImportError as exc:
            del sys.modules["pyverbs"]
            raise DeviceError(
                f"rdma transport: pyverbs does not load ({exc}); {HOW_TO_GET}"
            ) from exc
        return module
    raise DeviceError(f"rdma transport needs pyverbs, which is not installed: {HOW_TO_GET}")


def _mod(name: str) -> Any:
    pyverbs()
    return importlib.import_module(f"pyverbs.{name}")


def devices() -> list[str]:
    """Names of the RDMA devices here ([] when there are none, or no rdma-core)."""
    device = _mod("device")
    try:
        found = device.get_device_list()
    except Exception:  # PyverbsRDMAError when the kernel has no RDMA (no /sys/class/infiniband)
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in found]


def pick_device(wanted: str | None) -> str:
    """`wanted`, or the only/first device; DeviceError naming what is missing."""
    found = devices()
    if wanted:
        if wanted not in found:
            raise DeviceError(
                f"RDMA device {wanted!r} not found (devices: {', '.join(found) or 'none'}); "
                "for Soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev ETH"
            )
        return wanted
    if not found:
        raise DeviceError(
            "no RDMA device (ibv_get_device_list found none): needs a RoCE/InfiniBand NIC, or "
            "Soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev ETH"
        )
    return found[0]


def wc_status(status: int) -> str:
    """The name of a work-completion status, as ibv_wc_status_str says it."""
    enums = _mod("enums")
    for name in dir(enums):
        is_status = (
            name.startswith("IBV_WC_") and name.endswith("_ERR")
        ) or name == "IBV_WC_SUCCESS"
        if is_status and getattr(enums, name) == status:
            return name
    return f"status {status}"


def _verbs_error(what: str, exc: BaseException) -> TransportError:
    code = getattr(exc, "error_code", None)
    detail = f" (errno {code}: {os.strerror(code)})" if isinstance(code, int) and code > 0 else ""
    return TransportError(f"rdma: {what} failed: {exc}{detail}")


class Endpoint:
    """One side of an RC connection. Children are closed before their parents (QP, MRs, CQs,
    completion channel, PD, context), on every path, by close()."""

    def __init__(self, device: str, *, send_depth: int, recv_depth: int, port: int = 1) -> None:
        self._objects: list[Any] = []  # in creation order; closed in reverse
        self.device, self.port = device, port
        self.psn = int.from_bytes(os.urandom(3), "big")
        self._recv_sge: Any = None
        self._inflight = 0  # signaled sends not reaped yet
        self._lock = threading.Lock()  # posting sends and reaping their completions
        try:
            self._open(send_depth, recv_depth)
        except BaseException as exc:
            self.close()
            if isinstance(exc, TransportError | DeviceError):
                raise
            if isinstance(exc, Exception):
                raise _verbs_error(f"opening {device}", exc) from exc
            raise

    def _keep(self, obj: Any) -> Any:
        self._objects.append(obj)
        return obj

    def _open(self, send_depth: int, recv_depth: int) -> None:
        device, pd, cq, qp, enums, addr = (
            _mod(n) for n in ("device", "pd", "cq", "qp", "enums", "addr")
        )
        self.enums = enums
        ctx = self.ctx = self._keep(device.Context(name=self.device))
        attr = ctx.query_device()
        self.send_depth = min(send_depth, attr.max_qp_wr)
        self.recv_depth = min(recv_depth, attr.max_qp_wr)
        port = ctx.query_port(self.port)
        self.mtu, self.lid = port.active_mtu, port.lid
        self.gid_index, self.gid = self._pick_gid(port.gid_tbl_len)
        self.pd = self._keep(pd.PD(ctx))
        with _create_lock:
            before = _event_fds()
            self.channel = self._keep(cq.CompChannel(ctx))
            new = _event_fds() - before
        if len(new) != 1:
            raise TransportError(f"rdma: cannot find the completion channel's fd ({new})")
        self.channel_fd = new.pop()
        self.send_cq = self._keep(cq.CQ(ctx, self.send_depth, None, None, 0))
        self.recv_cq = self._keep(cq.CQ(ctx, self.recv_depth, None, self.channel, 0))
        cap = qp.QPCap(
            max_send_wr=self.send_depth, max_recv_wr=self.recv_depth, max_send_sge=1, max_recv_sge=1
        )
        init = qp.QPInitAttr(
            qp_type=enums.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap, sq_sig_all=0
        )
        self.qp = self._keep(qp.QP(self.pd, init))
        self._addr = addr
        self._qp_mod = qp
        self._scratch = np.zeros(64, np.uint8)  # the SGE every receive needs, even for an IMM
        self._scratch_mr = self.register(self._scratch, remote=False)
        wr = _mod("wr")
        self._wr = wr
        self._recv_sge = wr.SGE(self._scratch_mr.buf, len(self._scratch), self._scratch_mr.lkey)
        self.recv_cq.req_notify()

    def _pick_gid(self, table: int) -> tuple[int, str]:
        want = os.environ.get("NICOFFLOAD_RDMA_GID_INDEX")
        indices = [int(want)] if want else range(table)
        for i in indices:
            with contextlib.suppress(Exception):
                gid = str(self.ctx.query_gid(self.port, i))
                if gid.strip("0:"):
                    return i, gid
        raise DeviceError(
            f"RDMA device {self.device} port {self.port} has no GID: give its netdev an "
            "address (RoCE needs one: ip link set ETH up)"
        )

    @property
    def me(self) -> Peer:
        return Peer(self.qp.qp_num, self.psn, self.gid, self.lid)

    def register(self, array: np.ndarray, *, remote: bool) -> Any:
        """A memory region over `array` (zero-copy: the verbs device reads or writes it)."""
        return self.register_address(array.ctypes.data, array.nbytes, remote=remote)

    def _flags(self, remote: bool) -> int:
        e = self.enums
        return e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if remote else 0)

    def register_address(self, address: int, nbytes: int, *, remote: bool) -> Any:
        """A memory region over `nbytes` at `address`: host memory, or GPU memory where
        nvidia-peermem lets the verbs driver pin it."""
        try:
            return self._keep(
                _mod("mr").MR(self.pd, max(nbytes, 1), self._flags(remote), address=address)
            )
        except Exception as exc:
            raise _verbs_error(f"registering {nbytes} bytes on {self.device}", exc) from exc

    def connect(self, peer: Peer) -> None:
        """Move the QP through INIT, RTR and RTS towards `peer`."""
        e, qp, addr = self.enums, self._qp_mod, self._addr
        try:
            attr = qp.QPAttr(port_num=self.port)
            attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
            self.qp.to_init(attr)
            for _ in range(self.recv_depth):  # a QP in RESET takes no receives
                self.post_recv()
            gr = addr.GlobalRoute(dgid=addr.GID(peer.gid), sgid_index=self.gid_index)
            ah = addr.AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=peer.lid)
            attr = qp.QPAttr(port_num=self.port)
            attr.path_mtu = self.mtu
            attr.dest_qp_num = peer.qpn
            attr.rq_psn = peer.psn
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = 12
            attr.ah_attr = ah
            self.qp.to_rtr(attr)
            attr.sq_psn = self.psn
            attr.timeout = QP_TIMEOUT
            attr.retry_cnt = RETRIES
            attr.rnr_retry = RETRIES
            attr.max_rd_atomic = 1
            self.qp.to_rts(attr)
        except Exception as exc:
            raise _verbs_error(f"connecting QP {self.qp.qp_num} to QP {peer.qpn}", exc) from exc

    # --- data path ----------------------------------------------------------------------------

    def post_recv(self) -> None:
        self.qp.post_recv(self._wr.RecvWR(wr_id=0, num_sge=1, sg=[self._recv_sge]))

    def post(
        self,
        opcode: int,
        mr: Any,
        offset: int,
        length: int,
        *,
        imm: int | None = None,
        rkey: int = 0,
        remote_addr: int = 0,
    ) -> None:
        """Post one send-queue work request from `mr[offset:offset+length]` (signaled, so that
        a failure surfaces as an error completion)."""
        wr = self._wr
        sge = wr.SGE(mr.buf + offset, length, mr.lkey)
        kw: dict[str, Any] = {}
        if imm is not None:
            kw["imm_data"] = _imm_wire(imm)
        req = wr.SendWR(
            wr_id=1,
            opcode=opcode,
            num_sge=1,
            sg=[sge],
            send_flags=self.enums.IBV_SEND_SIGNALED,
            **kw,
        )
        if rkey:
            req.set_wr_rdma(rkey, remote_addr)
        with self._lock:
            while self._inflight >= self.send_depth - 1:
                self._reap(block=True)
            try:
                self.qp.post_send(req)
            except Exception as exc:
                raise _verbs_error(f"post_send on QP {self.qp.qp_num}", exc) from exc
            self._inflight += 1
            self._reap(block=False)

    def write_imm(self, mr: Any, offset: int, length: int, rkey: int, remote: int, imm: int):
        self.post(self.enums.IBV_WR_RDMA_WRITE_WITH_IMM, mr, offset, length, imm=imm, rkey=rkey,
                  remote_addr=remote)  # fmt: skip

    def write(self, mr: Any, offset: int, length: int, rkey: int, remote: int) -> None:
        self.post(self.enums.IBV_WR_RDMA_WRITE, mr, offset, length, rkey=rkey, remote_addr=remote)

    def send_imm(self, imm: int) -> None:
        self.post(
            self.enums.IBV_WR_SEND_WITH_IMM, self._scratch_mr, 0, 4, imm=imm
        )  # 1 SGE at least

    def drain_sends(self, timeout: float) -> None:
        """Wait until every posted send has completed (the peer has it); TransportError after
        `timeout` s or on an error completion."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._inflight:
                if time.monotonic() > deadline:
                    raise TransportError(f"rdma: {self._inflight} sends unacknowledged")
                self._reap(block=False)

    def _reap(self, *, block: bool) -> None:
        while True:
            n, wcs = self.send_cq.poll(16)
            for wc in wcs[:n]:
                self._inflight -= 1
                if wc.status != self.enums.IBV_WC_SUCCESS:
                    raise TransportError(
                        f"rdma: send on QP {self.qp.qp_num} failed: {wc_status(wc.status)} "
                        f"(vendor error {wc.vendor_err})"
                    )
            if n or not block:
                return

    def poll_recv(self) -> list[int]:
        """Immediates of the receive completions there now (each receive is re-posted)."""
        n, wcs = self.recv_cq.poll(32)
        out = []
        for wc in wcs[:n]:
            if wc.status != self.enums.IBV_WC_SUCCESS:
                raise TransportError(
                    f"rdma: receive on QP {self.qp.qp_num} failed: {wc_status(wc.status)} "
                    f"(vendor error {wc.vendor_err})"
                )
            self.post_recv()
            out.append(_imm_host(wc.imm_data))
        return out

    def wait_recv(self, timeout: float | None, also: int | None = None) -> list[int]:
        """Receive completions: busy-poll SPIN_S, then sleep on the completion channel (and on
        the `also` fd: the control socket) up to `timeout` s. [] on timeout or when `also` woke."""
        end = time.monotonic() + SPIN_S
        while True:
            got = self.poll_recv()
            if got or time.monotonic() > end:
                break
        if got or timeout == 0:
            return got
        poller = select.poll()
        poller.register(self.channel_fd, select.POLLIN)
        if also is not None:
            poller.register(also, select.POLLIN)
        self.recv_cq.req_notify()
        got = self.poll_recv()  # a completion that came before the notify was armed
        if got:
            return got
        ms = None if timeout is None else max(0, int(timeout * 1000))
        for fd, _ in poller.poll(ms):
            if fd == self.channel_fd:
                self.channel.get_cq_event(self.recv_cq)
                self.recv_cq.ack_events(1)
        return self.poll_recv()

    def close(self) -> None:
        """Close every verbs object, children first; idempotent."""
        objects, self._objects = self._objects, []
        first = None
        for obj in reversed(objects):
            try:
                obj.close()
            except Exception as exc:  # keep going: the others must still be closed
                first = first or exc
        if first is not None:
            raise _verbs_error(f"closing {self.device}", first) from first


def _imm_wire(value: int) -> int:
    # pyverbs passes imm_data through as the wire (big-endian) word: convert, as htonl would.
    return int.from_bytes(value.to_bytes(4, "little"), "big")


def _imm_host(value: int) -> int:
    return int.from_bytes(int(value).to_bytes(4, "big"), "little")


def _event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[infinibandevent]":
                fds.add(int(name))
    return fds
