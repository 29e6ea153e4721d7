"""One client connection to the agent: authentication, then the control calls and the ingress.

Whatever arrives is checked before it is used. A malformed or unexpected frame gets an ERROR
(request_id 0) and the connection is closed; a request whose values are wrong fails as an item
(`bad_request`) and the connection goes on. Nothing read here is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_agents import budget
from dpu_agents.admission import Admission
from dpu_agents.config import may_forward
from dpu_agents.ingress import Ingress, check_requests_fit
from dpu_agents.logs import log_event
from dpu_agents.session import Session
from dpu_agents.stagebuild import build_stage
from nicoffload.agent import auth
from nicoffload.agent.protocol import (
    CALLS,
    MAX_LOAD_BYTES,
    PROTOCOL,
    AuthMeta,
    ChallengeMeta,
    HelloMeta,
    LoadAck,
    LoadMeta,
    WelcomeMeta,
    frame,
)
from nicoffload.errors import AgentError, FrameError, TransportError
from nicoffload.transport import Sender, connect
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import DType, Header, Kind, decode_meta, error_frame

if TYPE_CHECKING:
    from dpu_agents.server import Agent

log = logging.getLogger("dpu_agents.connection")
FORWARD_SCHEMES = ("tcp://", "shm://", "rdma://")
WRONG_TOKEN = "wrong token"  # the refusal that counts against its address (server.AuthLimit)
STAGE_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")  # it becomes a metrics label
_DONTWAIT = int(socket.MSG_DONTWAIT)
DISCARD = 1 << 20  # a refused payload is read and dropped in pieces this big


class Refused(Exception):
    """Authentication failed; the client is told why, in general terms, and the agent counts it."""


class Full(Exception):
    """The client proved the token but the agent has no room for another session."""


class Connection(Ingress):
    def __init__(self, agent: Agent, sock: socket.socket, peer: str) -> None:
        self.agent, self.peer, self.cfg = agent, peer, agent.config
        self.evicted = ""  # why the agent dropped it before it authenticated
        self.ch = Channel(sock, f"client {peer}", io_timeout=self.cfg.io_timeout_s)
        self.session: Session | None = None
        self.forward_key: bytes | None = None  # set by the handshake (auth.session_keys)
        self.secured = False  # the handshake is done and every frame from here on has a MAC
        self.budget = budget.shared(agent)
        self.account = self.budget.client()
        self._late = False  # its payload did not arrive within payload_timeout_s
        self._lock = threading.Lock()
        self._outstanding = 0  # requests whose credit the client has not got back
        self._busy = False  # a LOAD or DRAIN is running on its helper thread
        self._done = False  # the reader has finished: a LOAD finishing late must not stay
        self.thread = threading.Thread(target=self.serve, name=f"conn {peer}", daemon=True)

    def serve(self) -> None:
        try:
            try:
                self._handshake()
            except Exception as exc:  # whatever a stranger causes is counted, not logged each
                self._refused(exc)
                return
            self._loop()
        except FrameError as exc:
            # A frame whose MAC fails (altered, replayed, injected) is counted on its own.
            reason = "bad_mac" if getattr(exc, "field", "") == "mac" else "bad_frame"
            self.agent.metrics.error(reason)
            log_event(log, logging.WARNING, reason, peer=self.peer, error=str(exc))
            self.ch.post(error_frame(exc), _DONTWAIT)
        except (TransportError, AgentError) as exc:
            log_event(log, logging.INFO, "connection_lost", peer=self.peer, error=str(exc))
        except Exception as exc:  # a bug here must cost one connection, never the agent
            self.agent.metrics.error("internal")
            log.exception("connection failed", extra={"fields": {"peer": self.peer}})
            self.ch.post(error_frame(AgentError(f"internal error: {exc!r}")), _DONTWAIT)
        finally:
            self._finish()

    def _refused(self, exc: Exception) -> None:
        """The handshake failed: tell the peer why in general terms (unless it was displaced,
        or is gone), count it by reason and address."""
        if isinstance(exc, Full):
            self.agent.metrics.error("too_many_connections")
            log_event(log, logging.WARNING, "connection_refused", peer=self.peer, reason=str(exc))
            self.ch.post(error_frame(AgentError(str(exc))), _DONTWAIT)
            return
        # Counted and logged before the peer is told: a client that has its answer can look
        # at the agent's log and metrics and find the refusal there.
        reason = self.evicted or str(exc)
        reply: Exception | None = None
        if isinstance(exc, Refused) and not self.evicted:
            reply = AgentError(f"authentication failed: {exc}")
        elif isinstance(exc, FrameError):
            reply = exc
            reason = "bad frame"  # the frame's details would make every line a new reason
        elif isinstance(exc, TransportError) and not self.evicted:
            reason = "connection lost"  # its message names the peer: a new reason each
        elif not isinstance(exc, (Refused, TransportError, AgentError)):
            reason = f"internal error: {exc!r}"
            log.exception("handshake failed", extra={"fields": {"peer": self.peer}})
        self.agent.metrics.error("auth")
        self.agent.refusals.note(reason, self.peer)
        if reply is not None:
            self.ch.post(error_frame(reply), _DONTWAIT)

    def _finish(self) -> None:
        with self._lock:
            self._done = True
            session = self.session
        if session is not None:
            session.close(self.cfg.drain_timeout_s)
        self.account.close()
        self.ch.shutdown()
        self.ch.close()
        self.agent.forget(self)

    def announce_drain(self, why: str) -> None:
        """An unsolicited DRAIN (request id 0) to an authenticated client: the agent takes no
        new requests from now on, and finishes those it has; the client stops submitting.
        Only once the handshake is done: a client still in it sees the connection close."""
        if self.secured:
            self.ch.post(frame(Kind.DRAIN, {"reason": why}, request_id=0), _DONTWAIT)

    def stop(self) -> None:
        """Wake the reader: it sees EOF (or stops waiting for memory) and finishes the session."""
        self.account.cancel()
        self.ch.shutdown()

    def evict(self, why: str) -> None:
        """Drop a connection still in its handshake (the agent no longer counts it)."""
        self.evicted = why
        self.ch.shutdown()

    def close(self) -> None:
        """Close a connection whose thread never ran."""
        self.ch.close()

    # --- authentication --------------------------------------------------------------------

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.cfg.handshake_timeout_s
        self.ch.record()  # the session's keys are bound to the four frames of the handshake
        hello = self._first(Kind.HELLO, HelloMeta, deadline)
        if hello.protocol != PROTOCOL:
            raise Refused(f"protocol {hello.protocol!r}, this agent speaks {PROTOCOL}")
        self.agent.admission.greeted(self)
        nonce = auth.nonce()
        # the agent's name only in WELCOME: a stranger learns nothing about the machine
        self.ch.send(frame(Kind.CHALLENGE, ChallengeMeta(nonce, "")))
        answer = self._first(Kind.AUTH, AuthMeta, deadline)
        if len(answer.nonce) != auth.NONCE_BYTES:
            raise Refused(f"a client nonce of {len(answer.nonce)} bytes")
        try:
            auth.check(
                auth.client_proof(self.agent.token, nonce, answer.nonce), answer.proof, "client"
            )
        except AgentError:
            raise Refused(WRONG_TOKEN) from None
        why = self.agent.admission.promote(self)
        if why == Admission.GONE:
            raise Refused(self.evicted or why)
        if why:
            raise Full(why)
        proof = auth.server_proof(self.agent.token, nonce, answer.nonce)
        # the most one REQUEST frame (a batch) may carry and still fit this client's budget
        most = min(self.cfg.max_request_bytes, self.account.most(budget.QUEUED))
        welcome = WelcomeMeta(proof, self.agent.name, self.agent.pool.n, most)
        self.ch.send(frame(Kind.WELCOME, welcome))
        keys = auth.session_keys(self.agent.token, nonce, answer.nonce, self.ch.transcript())
        self.ch.secure(send_key=keys.agent, recv_key=keys.client)  # every later frame: a MAC
        self.forward_key = keys.forward
        self.secured = True
        log_event(log, logging.INFO, "authenticated", peer=self.peer, client=hello.client)

    def _first(self, kind: Kind, type_: Any, deadline: float) -> Any:
        if not self.ch.readable(deadline - time.monotonic()):
            raise Refused(f"no {kind.name} within {self.cfg.handshake_timeout_s} s")
        got = self.ch.read_head(0)
        if got is None:
            raise Refused(f"closed before {kind.name}")
        if got[0].kind is not kind:
            raise Refused(f"{got[0].kind.name} before authentication (expected {kind.name})")
        try:
            return decode_meta(got[1], type_)
        except FrameError as exc:
            raise Refused(f"malformed {kind.name}: {exc}") from None

    # --- after authentication --------------------------------------------------------------

    def _loop(self) -> None:
        limit = max(self.cfg.max_request_bytes, MAX_LOAD_BYTES)
        while True:
            if not self.ch.readable(self.cfg.idle_timeout_s):
                raise TransportError(f"silent for {self.cfg.idle_timeout_s} s")
            got = self.ch.read_head(limit)
            if got is None:
                return
            header, meta = got
            if header.kind is Kind.REQUEST:
                self._request(header, meta)
            elif header.kind in CALLS:
                self._call(header, meta)
            elif header.kind is Kind.ERROR:
                raise TransportError("the client reported an error")
            else:
                raise FrameError(f"malformed frame: kind: unexpected {header.kind.name}")

    def _payload(self, header: Header, limit: int, keep: bool = True) -> memoryview:
        """The frame's payload, checked against `limit` before anything is allocated (a
        request's is also in the budget by now); `keep=False` reads it and drops it."""
        if header.dtype is not DType.NONE:
            raise FrameError(f"malformed frame: dtype: {header.kind.name} carries raw bytes")
        if header.payload_len > limit:
            raise FrameError(
                f"malformed frame: payload_len: {header.payload_len} > {limit} "
                f"for {header.kind.name}"
            )
        n = header.payload_len
        if n == 0:
            return memoryview(b"")
        # Pages are touched as bytes arrive (np.empty, not a zeroed bytearray), and the whole
        # payload must be in within payload_timeout_s, however it trickles.
        buf = memoryview(np.empty(min(n, DISCARD) if not keep else n, np.uint8))
        deadlines = self.budget.deadlines
        deadlines.arm(id(self), time.monotonic() + self.cfg.payload_timeout_s, self._too_slow)
        try:
            for at in range(0, n, len(buf)):
                self.ch.read_into(buf[: min(len(buf), n - at)])
        except TransportError:
            if self._late:
                raise TransportError(
                    f"{self.peer}: {n} payload bytes not in within {self.cfg.payload_timeout_s} s"
                ) from None
            raise
        finally:
            deadlines.disarm(id(self))
        # writable: a REQUEST's tensors are views of it (split_request), and numba compiles
        # again, for seconds, for a read-only array; its bytes values are read-only views
        return buf if keep else memoryview(b"")

    def _too_slow(self) -> None:
        self._late = True
        why = f"a payload not received within payload_timeout_s ({self.cfg.payload_timeout_s} s)"
        self.ch.post(error_frame(AgentError(why)), _DONTWAIT)
        self.ch.shutdown()

    def _credit(self, n: int) -> None:
        with self._lock:
            self._outstanding -= n
        self.ch.post(frame(Kind.CREDIT, batch_size=n))

    def _call(self, header: Header, blob: bytes) -> None:
        call = header.request_id
        payload = bytes(self._payload(header, MAX_LOAD_BYTES if header.kind is Kind.LOAD else 0))
        if header.kind is Kind.HEARTBEAT:
            self.ch.send(frame(Kind.HEARTBEAT, request_id=call))
        elif header.kind is Kind.STATS:
            self.ch.send(frame(Kind.STATS, self.agent.stats(self.session), request_id=call))
        elif header.kind is Kind.SHUTDOWN:
            log_event(log, logging.INFO, "shutdown_requested", peer=self.peer)
            self.ch.send(frame(Kind.ACK, {"shutdown": True}, request_id=call))
            self.agent.request_stop()
        else:
            load = decode_meta(blob, LoadMeta) if header.kind is Kind.LOAD else None
            with self._lock:
                if self._busy:
                    self._reply_error(call, AgentError("another LOAD or DRAIN is still running"))
                    return
                self._busy = True
            threading.Thread(
                target=self._slow_call, args=(header.kind, call, load, payload), daemon=True
            ).start()

    def _slow_call(self, kind: Kind, call: int, load: LoadMeta | None, payload: bytes) -> None:
        reply: Any = None
        error: BaseException | None = None
        try:
            if kind is Kind.LOAD:
                assert load is not None
                reply = self._load(load, payload)
            else:
                reply = self._drain()
        except Exception as exc:  # the call fails, the connection goes on
            error = exc
        with self._lock:  # free before the answer: the client may call again at once
            self._busy = False
        if error is not None:
            self._reply_error(call, error)
        else:
            self.ch.post(frame(Kind.ACK, reply, request_id=call))

    def _reply_error(self, call: int, exc: BaseException) -> None:
        if not isinstance(exc, (AgentError, TransportError)):
            log.exception("call failed", extra={"fields": {"peer": self.peer}})
        self.ch.post(error_frame(exc, request_id=call))

    def _load(self, load: LoadMeta, payload: bytes) -> LoadAck:
        if self.session is not None:
            raise AgentError("a stage is already loaded on this connection; open another")
        if not load.forward_to.startswith(FORWARD_SCHEMES):
            raise AgentError(
                f"forward_to {load.forward_to[:100]!r}: expected tcp://..., shm://... or rdma://..."
            )
        if not STAGE_NAME.fullmatch(load.stage):
            raise AgentError(
                f"stage name {load.stage[:80]!r}: expected 1 to 64 of A-Z a-z 0-9 _ . @ -"
            )
        self._check_forward(load.forward_to)
        if not 0 <= load.yaml_bytes <= len(payload):
            raise AgentError(f"yaml_bytes {load.yaml_bytes} > the payload of {len(payload)}")
        try:
            yaml_text = payload[: load.yaml_bytes].decode("utf-8")
            plan_text = payload[load.yaml_bytes :].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AgentError(f"the pipeline or plan is not utf-8: {exc}") from None
        t0 = time.perf_counter()
        built = build_stage(
            yaml_text, plan_text, load.stage, load.batch_max_size, load.batch_max_wait_ms, self.cfg
        )
        check_requests_fit(built.inputs)
        sender = self._connect(load.forward_to, built.pipeline_id, built.next_stage_id)
        try:
            session = Session(
                built,
                sender,
                self.agent.pool,
                self.agent.metrics,
                on_credit=self._credit,
                on_fatal=self._fatal,
                forward_timeout=self.cfg.forward_timeout_s,
                dedup_window=self.cfg.dedup_window,
                account=self.account,
                source=[
                    yaml_text,
                    plan_text,
                    load.stage,
                    load.batch_max_size,
                    load.batch_max_wait_ms,
                ],
                config=dataclasses.asdict(self.cfg),
            )
        except BaseException:
            sender.close()
            raise
        with self._lock:
            if not self._done:
                self.session = session
        if self.session is not session:
            session.close(0.1)
            raise AgentError("the connection closed while the stage was loading")
        log_event(
            log,
            logging.INFO,
            "stage_loaded",
            peer=self.peer,
            pipeline=built.pipeline.name,
            stage=load.stage,
            forward_to=load.forward_to,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return LoadAck(session.name, self.cfg.window, built.outputs(), tuple(built.inputs))

    def _check_forward(self, forward_to: str) -> None:
        here = self.ch.sock.getsockname()[0]
        if not may_forward(forward_to, self.peer.rpartition(":")[0], here, self.cfg.forward_allow):
            raise AgentError(
                f"forward_to {forward_to[:100]!r}: not an address this agent forwards to (the "
                "client's own IP address, or one in the agent's forward_allow)"
            )

    def _connect(self, forward_to: str, pipeline_id: int, stage_id: int) -> Sender:
        """The sender to the next placement. However it fails (refused, closed, silent, a peer
        speaking another protocol, a segment not ours), the client is told the same, at the
        same moment (the connect deadline): a LOAD is no probe of what the agent can reach.
        The operator's log has the cause."""
        deadline = time.monotonic() + self.cfg.handshake_timeout_s
        try:
            return connect(
                forward_to,
                timeout=self.cfg.handshake_timeout_s,
                pipeline_id=pipeline_id,
                stage_id=stage_id,
                key=self.forward_key,  # a receiver with the session's forward key checks it
            )
        except (TransportError, OSError, ValueError) as exc:
            why = {"peer": self.peer, "forward_to": forward_to, "error": str(exc)[:200]}
            log_event(log, logging.WARNING, "forward_refused", **why)
        time.sleep(max(0.0, deadline - time.monotonic()))
        raise AgentError(
            f"forward_to {forward_to[:100]!r}: no receiver could be opened there within "
            f"{self.cfg.handshake_timeout_s} s"
        )

    def _drain(self) -> dict[str, Any]:
        s = self.session
        if s is None:
            return {"drained": True, "forwarded": 0}
        ok = s.drain(self.cfg.drain_timeout_s)
        if not ok:
            raise AgentError(f"drain: {s.admitted - s.forwarded} requests still in flight")
        return {"drained": True, "forwarded": s.forwarded}

    def _fatal(self, exc: BaseException) -> None:
        """The session cannot go on (its receiver is gone): tell the client, then hang up."""
        self.ch.post(error_frame(AgentError(f"forwarding failed: {exc}")), _DONTWAIT)
        self.ch.shutdown()
