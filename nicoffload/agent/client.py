"""Talking to a DPU agent: `AgentClient`, one authenticated connection (load a stage, submit
requests, stats, drain, liveness). `nicoffload.client.Client` runs a whole pipeline on one.

The protocol is described in `nicoffload.agent.protocol`. An agent that closes, errs, or stays silent
past `timeout` is dead: every later call raises AgentError, and so does a blocked `submit`. After
the handshake every frame carries a MAC: one that fails (altered, injected, replayed) is the
agent dead too, never an answer. `forward_key` is the key to listen for the stage's outputs with.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from nicoffload.agent import auth
from nicoffload.agent.protocol import (
    PROTOCOL,
    AuthMeta,
    ChallengeMeta,
    HelloMeta,
    LoadAck,
    LoadMeta,
    WelcomeMeta,
    frame,
    request_frames,
)
from nicoffload.errors import AgentError, FrameError, TransportError
from nicoffload.planner.plan import Plan
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import ErrorMeta, Kind, decode_meta

LOAD_TIMEOUT = 300.0  # binding a stage compiles its kernels (numba) the first time
READ_TO_END_S = 0.5  # a send that failed waits this long for the reader to read what came first


def parse_agent_address(address: str) -> tuple[str, int]:
    """('h', p) from 'h:p' or 'tcp://h:p' ('[::1]:p' for IPv6); AgentError if malformed."""
    text = address.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise AgentError(f"bad agent address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class _Call:
    __slots__ = ("done", "kind", "meta")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.kind: Kind | None = None
        self.meta = b""


class AgentClient:
    """One authenticated connection to an agent, with at most one loaded stage."""

    def __init__(
        self,
        address: str,
        token: bytes,
        *,
        timeout: float = 10.0,
        heartbeat_s: float | None = None,
        connect_timeout: float | None = None,
        client_name: str = "nicoffload",
    ) -> None:
        """`timeout`: an agent silent this long is dead (heartbeats every `heartbeat_s`,
        timeout / 4 by default); `connect_timeout` (default `timeout`) bounds connect + login."""
        self.address, self.timeout = address, timeout
        connect_timeout = connect_timeout or timeout
        self._heartbeat_s = heartbeat_s or timeout / 4
        host, port = parse_agent_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise AgentError(f"cannot connect to the agent at {address}: {exc}") from exc
        self.local_host = sock.getsockname()[0]  # where the agent can reach this host
        self._ch = Channel(sock, f"agent at {address}", io_timeout=timeout)
        self._cond = threading.Condition()
        self._calls: dict[int, _Call] = {}
        self._next_call = 0
        self._credits = 0
        self._error: AgentError | None = None
        self._closed = False
        self.draining: str | None = None  # the agent said it drains (it takes nothing new): why
        self.loaded: LoadAck | None = None
        try:
            self.agent = self._handshake(token, client_name, connect_timeout)
        except BaseException as exc:
            self._ch.close()
            if isinstance(exc, (TransportError, OSError)):
                raise AgentError(f"agent at {address}: handshake failed: {exc}") from exc
            raise
        self._last_seen = time.monotonic()
        self._reader = threading.Thread(target=self._read_loop, name="agent-reader", daemon=True)
        self._beater = threading.Thread(target=self._heartbeat, name="agent-heartbeat", daemon=True)
        self._reader.start()
        self._beater.start()

    def _handshake(self, token: bytes, client_name: str, timeout: float) -> WelcomeMeta:
        self._ch.record()  # the session's keys are bound to the four frames of the handshake
        self._ch.send(frame(Kind.HELLO, HelloMeta(client_name)))
        challenge = decode_meta(self._expect(Kind.CHALLENGE, timeout), ChallengeMeta)
        if challenge.protocol != PROTOCOL:  # its REQUEST format is not ours: nothing would run
            raise AgentError(
                f"agent at {self.address} speaks {challenge.protocol!r}, this client {PROTOCOL}"
            )
        mine = auth.nonce()
        proof = auth.client_proof(token, challenge.nonce, mine)
        self._ch.send(frame(Kind.AUTH, AuthMeta(mine, proof)))
        welcome = decode_meta(self._expect(Kind.WELCOME, timeout), WelcomeMeta)
        auth.check(auth.server_proof(token, challenge.nonce, mine), welcome.proof, "agent")
        keys = auth.session_keys(token, challenge.nonce, mine, self._ch.transcript())
        self._ch.secure(send_key=keys.client, recv_key=keys.agent)  # every later frame: a MAC
        self.forward_key = keys.forward
        return welcome

    def _expect(self, kind: Kind, timeout: float) -> bytes:
        if not self._ch.readable(timeout):
            raise AgentError(f"agent at {self.address}: no {kind.name} within {timeout} s")
        got = self._ch.read_head(0)
        if got is None:
            raise AgentError(f"agent at {self.address} closed the connection")
        if got[0].kind is Kind.ERROR:
            raise AgentError(f"agent at {self.address}: {_message(got[1])}")
        if got[0].kind is not kind:
            raise AgentError(f"agent at {self.address}: {got[0].kind.name}, expected {kind.name}")
        return got[1]

    # --- liveness ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._error is None and not self._closed

    @property
    def failed(self) -> AgentError | None:
        """Why the agent was found dead (it closed, erred or stayed silent), else None."""
        return self._error

    def _die(self, why: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = AgentError(f"agent at {self.address}: {why}")
            for call in self._calls.values():
                call.done.set()
            self._cond.notify_all()
        self._ch.shutdown()

    def wait_gone(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the control connection to end (True once it has): a
        transfer that ended first learns from it why (an agent that drains says so there)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.alive, timeout)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise AgentError(f"the connection to the agent at {self.address} is closed")

    def _read_loop(self) -> None:
        try:
            while (got := self._ch.read_head(0)) is not None:
                header, meta = got
                self._last_seen = time.monotonic()
                if header.kind is Kind.CREDIT:
                    with self._cond:
                        self._credits += header.batch_size
                        self._cond.notify_all()
                elif header.kind is Kind.ERROR and header.request_id == 0:
                    return self._die(_message(meta))
                elif header.kind is Kind.DRAIN and header.request_id == 0:
                    with self._cond:  # unsolicited: the agent shuts down, finishing what it has
                        self.draining = _reason(meta)
                        self._cond.notify_all()
                elif header.kind in (Kind.ACK, Kind.STATS, Kind.HEARTBEAT, Kind.ERROR):
                    with self._cond:
                        call = self._calls.pop(header.request_id, None)
                    if call is not None:
                        call.kind, call.meta = header.kind, meta
                        call.done.set()
                else:
                    raise FrameError(f"malformed frame: kind: unexpected {header.kind.name}")
            self._die("closed the connection")
        except TransportError as exc:
            self._die(str(exc))

    def _heartbeat(self) -> None:
        beat = frame(Kind.HEARTBEAT)  # request_id 0: a reply is matched to no call
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: not self.alive, self._heartbeat_s):
                    return
            silent = time.monotonic() - self._last_seen
            if silent > self.timeout:
                return self._die(f"no answer for {silent:.1f} s (timeout {self.timeout} s)")
            if not self._ch.post(beat):
                return self._die("the connection is broken")

    # --- calls ---------------------------------------------------------------------------------

    def _call(
        self, kind: Kind, meta: Any = None, payload: bytes = b"", timeout: float = 0
    ) -> bytes:
        with self._cond:
            self._check()
            self._next_call += 1
            call_id, call = self._next_call, _Call()
            self._calls[call_id] = call
        timeout = timeout or self.timeout
        try:
            self._ch.send(frame(kind, meta, request_id=call_id, payload=len(payload)), [payload])
        except TransportError as exc:
            self._die(str(exc))
        if not call.done.wait(timeout) or call.kind is None:
            with self._cond:
                self._calls.pop(call_id, None)
            self._check()
            raise AgentError(
                f"agent at {self.address}: no answer to {kind.name} within {timeout} s"
            )
        if call.kind is Kind.ERROR:
            raise AgentError(f"agent at {self.address}: {kind.name} failed: {_message(call.meta)}")
        return call.meta

    def load(
        self,
        pipeline_yaml_text: str,
        plan: Plan,
        stage: str,
        forward_to: str,
        *,
        batch_max_size: int,
        batch_max_wait_ms: float,
        timeout: float = LOAD_TIMEOUT,
    ) -> LoadAck:
        """Build the pipeline on the agent, bind `stage` of `plan`, and connect its outputs to
        the receiver listening at `forward_to`. Returns the session, credits and outputs."""
        if self.loaded is not None:
            raise AgentError("a stage is already loaded on this connection; open another")
        yaml_bytes = pipeline_yaml_text.encode()
        payload = yaml_bytes + json.dumps(plan.to_json()).encode()
        meta = LoadMeta(
            stage, forward_to, batch_max_size, float(batch_max_wait_ms), len(yaml_bytes)
        )
        ack = decode_meta(self._call(Kind.LOAD, meta, payload, timeout), LoadAck)
        with self._cond:
            self.loaded = ack
            self._credits += ack.window
            self._cond.notify_all()
        return ack

    def submit(
        self, request_id: int, values: Mapping[str, Any], *, timeout: float | None = None
    ) -> None:
        """Send one request to the ingress (a batch of one: see `submit_batch`)."""
        self.submit_batch(request_id, [values], timeout=timeout)

    def submit_batch(
        self,
        first_id: int,
        items: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,
    ) -> list[int]:
        """Send a batch of requests (ids first_id, first_id + 1, ...) to the ingress: one
        REQUEST frame and one credit for the lot (more when it is larger than one frame may
        carry: WELCOME's max_request_bytes); blocks while the agent holds every credit
        (AgentError once the agent is dead, or after `timeout` s if one is given).

        An item larger than max_request_bytes is not sent: a frame without its values tells
        the agent its size, and the agent fails it as `too_large` (its result comes as every
        failed item's does, in order, naming the size and the limit) while the rest of the
        batch runs. Returns the ids of the items so kept back.

        An item maps value keys to bytes, str (text) or numpy arrays (tensors: a value leaving
        an earlier stage, "decode" or "tok.input_ids"); of those, only the keys the loaded
        stage reads (LOAD's `inputs`) are sent. A value the wire cannot carry (an array of a
        dtype it has no code for, or with a dim of 0) is a ValueError before anything is sent.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        limit = self.agent.max_request_bytes
        reads = self.loaded.inputs if self.loaded is not None else ()
        if reads:
            items = [{k: v[k] for k in reads if k in v} for v in items]
        kept, rid = [], first_id
        for n, head, parts in request_frames(first_id, items, limit):
            self._take_credit(deadline, timeout)
            try:
                self._ch.send(head, parts or ())
            except TransportError as exc:
                # The agent closed its end: what it said before (a drain notice, an ERROR) is
                # still to be read. The reader reads it to the end first (briefly), then dies.
                self._reader.join(READ_TO_END_S)
                self._die(str(exc))
                self._check()
            if parts is None:
                kept.append(rid)
            rid += n
        return kept

    def _take_credit(self, deadline: float | None, timeout: float | None) -> None:
        with self._cond:
            if self.loaded is None:
                raise AgentError("no stage is loaded on this connection: call load() first")
            while self._credits <= 0:
                self._check()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise AgentError(f"agent at {self.address}: no credit within {timeout} s")
                self._cond.wait(left)
            self._check()
            self._credits -= 1

    def stats(self) -> dict[str, Any]:
        return decode_meta(self._call(Kind.STATS))

    def drain(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until every request submitted so far has been forwarded."""
        return decode_meta(self._call(Kind.DRAIN, timeout=timeout))

    def shutdown(self) -> None:
        """Ask the agent to drain and exit (it answers first)."""
        self._call(Kind.SHUTDOWN)

    def close(self) -> None:
        """Hang up; the agent finishes what it admitted, then closes the stage's sender."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._ch.shutdown()
        self._reader.join(5.0)
        self._beater.join(5.0)
        with contextlib.suppress(OSError):
            self._ch.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reason(blob: bytes) -> str:
    """The reason an unsolicited DRAIN gives (any text, shown as given, bounded)."""
    try:
        doc = decode_meta(blob)
    except Exception:  # a malformed reason must not cost the connection
        doc = None
    why = doc.get("reason") if isinstance(doc, dict) else None
    return str(why)[:200] if why else "the agent drains"


def _message(blob: bytes) -> str:
    try:
        meta = decode_meta(blob, ErrorMeta)
    except FrameError as exc:
        return f"an unreadable ERROR frame ({exc})"
    return f"{meta.error}: {meta.message}"
