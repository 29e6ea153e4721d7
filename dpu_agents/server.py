"""The DPU agent daemon: `nicoffload-agent --listen HOST:PORT --token-file FILE [--cores N]`.

An Agent accepts client connections (each authenticated, each with at most one loaded stage),
runs the stages' items on a worker pool of `cores` threads, and on SIGTERM or a SHUTDOWN call
drains the work in flight, then exits 0; if it can no longer accept connections (its listener is
broken, its accept loop died) it exits 1, so that a supervisor restarts it. It prints one JSON
line on stdout once it listens: `{"event": "listening", "address": "127.0.0.1:43211"}`; logs go
to stderr as JSON lines.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from dpu_agents import logs
from dpu_agents.admission import Admission
from dpu_agents.config import AgentConfig, load_config, split_hostport
from dpu_agents.connection import WRONG_TOKEN, Connection
from dpu_agents.logs import Tally, log_event
from dpu_agents.metrics import Metrics
from dpu_agents.metrics_http import MetricsServer
from dpu_agents.procs import ProcPool
from dpu_agents.session import WorkerPool
from nicoffload.agent import auth
from nicoffload.errors import NicoffloadError, UserError
from nicoffload.transport.frame import HEADER_SIZE

log = logging.getLogger("dpu_agents.server")
SWEEP_S = 0.25  # how often the accept loop drops late handshakes and writes due log lines
LATE_S = 0.5  # past the handshake deadline: the connection has had its chance to be told why
BACKOFF_S = (0.01, 1.0)  # after a failed accept (EMFILE, no thread), doubling up to the last
# The listener itself is unusable: no waiting will help, a restart might.
FATAL_ACCEPT = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK, errno.EOPNOTSUPP})


class Agent:
    """The daemon's state: listener, connections, worker pool, metrics. `serve()` blocks until
    `request_stop()` (a signal, a SHUTDOWN call), then drains and closes everything."""

    def __init__(self, config: AgentConfig, token: bytes) -> None:
        self.config, self.token = config, token
        self.name = socket.gethostname()
        self.metrics = Metrics()
        self.draining = False
        self.exit_code = 0
        self._closed = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.admission = Admission(
            config.max_handshakes,
            config.max_handshakes_per_address,
            config.max_connections,
            config.handshake_timeout_s + LATE_S,
        )
        self.auth_limit = AuthLimit(
            config.auth_failures, config.auth_failures_window_s, config.auth_block_s
        )
        # what strangers cause: counted, not a line each; wrong tokens also per address
        self.refusals = Refusals(Tally(log, "auth_refused"), self.auth_limit)
        self._accept_errors = Tally(log, "accept_failed", level=logging.ERROR)
        host, port = split_hostport(config.listen, "listen")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=64)
        except OSError as exc:
            raise NicoffloadError(f"agent: cannot listen on {config.listen}: {exc}") from exc
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.address = f"{shown}:{self._listener.getsockname()[1]}"
        self._listener.setblocking(False)  # one acceptor; a connection gone before accept: no wait
        self._wake_r, self._wake_w = socket.socketpair()
        self._http: MetricsServer | None = None
        self.metrics_address = ""
        try:
            if config.metrics:
                self._http = _metrics_server(config, self.metrics)
                self.metrics_address = self._http.address
            cores = config.cores or len(os.sched_getaffinity(0))
            self.pool: WorkerPool | ProcPool = (
                ProcPool(cores, config.worker_timeout_s)
                if config.processes(cores)
                else WorkerPool(cores)
            )
        except BaseException:
            if self._http is not None:
                self._http.close()
            for s in (self._listener, self._wake_r, self._wake_w):
                s.close()
            raise
        self._acceptor = threading.Thread(target=self._accept_loop, name="accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        """Accept until stopped. Whatever fails is logged (counted) and retried after a back-off
        (EMFILE, a thread that cannot start, a bug); a broken listener, or anything that escapes
        here, fails the agent (exit 1) rather than leave it alive and deaf."""
        poll = select.poll()
        poll.register(self._listener, select.POLLIN)
        poll.register(self._wake_r, select.POLLIN)
        backoff = BACKOFF_S[0]
        try:
            while not self._stop.is_set():
                try:
                    self._accept_ready(poll)
                    backoff = BACKOFF_S[0]
                except Exception as exc:
                    if isinstance(exc, OSError) and exc.errno in FATAL_ACCEPT:
                        raise
                    self._accept_errors.note(f"{type(exc).__name__}: {exc}")
                    self._stop.wait(backoff)
                    backoff = min(2 * backoff, BACKOFF_S[1])
        except BaseException as exc:
            self.fail(f"the accept loop cannot go on: {exc!r}")

    def _accept_ready(self, poll: select.poll) -> None:
        ready = poll.poll(SWEEP_S * 1000)
        self._sweep()
        if self._stop.is_set() or not any(fd == self._listener.fileno() for fd, _ in ready):
            return
        try:
            sock, addr = self._listener.accept()
        except BlockingIOError:
            return
        if self.auth_limit.blocked(addr[0]):  # it guessed wrong too often: not a byte read
            sock.close()
            self.metrics.error("auth_rate_limited")
            self.refusals.note("dropped: too many wrong tokens", f"{addr[0]}:{addr[1]}")
            return
        try:
            sock.setblocking(True)
            conn = Connection(self, sock, f"{addr[0]}:{addr[1]}")
        except BaseException:
            sock.close()
            raise
        for old in self.admission.admit(conn, addr[0], _sent_a_head(sock)):
            old.evict("displaced by newer connections")
        self._count()
        try:
            conn.thread.start()
        except BaseException:
            self.admission.forget(conn)
            conn.close()
            self._count()
            raise

    def _sweep(self) -> None:
        for conn in self.admission.expired():
            conn.evict(f"no login within {self.config.handshake_timeout_s} s")
        self.refusals.flush()
        self._accept_errors.flush()

    def _count(self) -> None:
        self.metrics.connections(sum(self.admission.counts()))

    def forget(self, conn: Connection) -> None:
        self.admission.forget(conn)
        self._count()

    def fail(self, why: str) -> None:
        """The agent cannot serve: stop, and exit 1."""
        log_event(log, logging.CRITICAL, "agent_failed", error=why)
        self.exit_code = 1
        self.request_stop()

    def stats(self, mine: Any = None) -> dict[str, Any]:
        """The STATS document; `mine` (the asking connection's session, if any) adds `own`:
        that session's kernel figures alone, unrounded, with its `session` id (what a host's
        call subtracts from: the `kernels` sum every session of a stage name, another host's
        too, and are rounded)."""
        doc = self.metrics.snapshot()
        doc.update(agent=self.name, cores=self.pool.n, draining=self.draining)
        doc["pool"] = {
            "kind": "processes" if self.pool.processes else "threads",
            "restarts": self.pool.restarts(),
        }
        conns = self.admission.sessions()
        sessions = [(c.peer, c.session) for c in conns if c.session is not None]
        doc["sessions"] = {
            f"{peer}/{s.name}": {
                "admitted": s.admitted,
                "forwarded": s.forwarded,
                "rows_fresh": s.rows_fresh,  # rows of varying shape past their slot's buffer
            }
            for peer, s in sessions
        }
        doc["kernels"] = _kernel_times(s for _, s in sessions)
        if mine is not None:
            own = _kernel_times([mine], digits=None).get(mine.name, {})
            doc["own"] = own | {"session": id(mine)}
        return doc

    def request_stop(self) -> None:
        self._stop.set()

    def serve(self) -> int:
        """Block until asked to stop, then drain and close (bounded by drain_timeout_s);
        returns the exit code (1: the agent failed)."""
        while not self._stop.wait(0.5):
            if not self._acceptor.is_alive():
                self.fail("the accept loop stopped")
        self.close()
        return self.exit_code

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self.draining = True
        log_event(log, logging.INFO, "draining")
        for c in self.admission.sessions():  # told first: a client stops sending what we refuse
            c.announce_drain("the agent is shutting down")
        self._wake_w.send(b"x")
        self._acceptor.join(5.0)
        deadline = time.monotonic() + self.config.drain_timeout_s
        conns = self.admission.all()
        for c in conns:
            if c.session is not None and not c.session.drain(max(0.0, deadline - time.monotonic())):
                log_event(log, logging.WARNING, "drain_incomplete", peer=c.peer)
        for c in conns:
            c.stop()
        for c in conns:
            c.thread.join(max(0.1, deadline - time.monotonic()))
        self.pool.close()
        if self._http is not None:
            self._http.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self.refusals.flush(force=True)
        self._accept_errors.flush(force=True)
        log_event(log, logging.INFO, "stopped", **self.metrics.snapshot())

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AuthLimit:
    """Wrong tokens per address: `limit` of them within `window_s`, and that address's new
    connections are closed as they are accepted for `block_s`. At most MAX_ADDRESSES are
    followed, and as many blocked (past that, the oldest is forgotten)."""

    MAX_ADDRESSES = 4096

    def __init__(
        self, limit: int, window_s: float, block_s: float, clock: Any = time.monotonic
    ) -> None:
        self.limit, self.window_s, self.block_s, self._clock = limit, window_s, block_s, clock
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._until: OrderedDict[str, float] = OrderedDict()  # address -> its block's end, in order

    def failed(self, address: str) -> None:
        now = self._clock()
        with self._lock:
            times = self._failures.pop(address, None) or deque()
            times.append(now)
            while times and times[0] <= now - self.window_s:
                times.popleft()
            if len(times) >= self.limit:
                self._until.pop(address, None)
                self._until[address] = now + self.block_s  # the latest end last
                times.clear()
            self._failures[address] = times  # the most recent failure last
            for table in (self._failures, self._until):
                while len(table) > self.MAX_ADDRESSES:
                    table.popitem(last=False)

    def blocked(self, address: str) -> bool:
        now = self._clock()
        with self._lock:
            while self._until and next(iter(self._until.values())) <= now:
                self._until.popitem(last=False)  # lapsed
            return address in self._until


class Refusals:
    """The handshakes that failed: counted in the log (a Tally), and a wrong token counted
    against its address too (`AuthLimit`)."""

    def __init__(self, tally: Tally, limit: AuthLimit) -> None:
        self._tally, self._limit = tally, limit

    def note(self, reason: str, peer: str = "") -> None:
        self._tally.note(reason, peer)
        if reason == WRONG_TOKEN:
            self._limit.failed(peer.rpartition(":")[0] or peer)

    def flush(self, force: bool = False) -> None:
        self._tally.flush(force)


def _metrics_server(cfg: AgentConfig, metrics: Metrics) -> MetricsServer:
    host, port = split_hostport(cfg.metrics, "metrics")
    token = auth.read_token(cfg.metrics_token_file) if cfg.metrics_token_file else None
    try:
        return MetricsServer(
            host,
            port,
            metrics.registry,
            limit=cfg.metrics_max_connections,
            timeout_s=cfg.metrics_timeout_s,
            token=token,
        )
    except OSError as exc:
        raise NicoffloadError(f"agent: cannot serve metrics on {cfg.metrics}: {exc}") from exc


def _sent_a_head(sock: socket.socket) -> bool:
    """Whether a whole frame header is already waiting: a client sends HELLO as it connects."""
    try:
        return len(sock.recv(HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)) == HEADER_SIZE
    except OSError:
        return False


def _kernel_times(sessions: Any, digits: int | None = 4) -> dict[str, Any]:
    """Per stage (summed over its sessions, over their lifetime), what its kernels cost per item
    on the agent's workers: CPU time and wall time inside the kernel calls
    (`nicoffload.runtime.stage.StepTime`) and how many calls each step made, the figures a host
    compares with the planner's prediction (a call's own: the host subtracts what it read when
    the call began, `RemoteFront.begin_call`)."""
    totals: dict[str, dict[str, list[float]]] = {}
    for s in sessions:
        steps = totals.setdefault(s.name, {})
        for step, t in s.built.stage.times().items():
            acc = steps.setdefault(step, [0.0, 0.0, 0])
            acc[0] += t.cpu_ms * t.calls
            acc[1] += t.wall_ms * t.calls
            acc[2] += t.calls
    out = {}

    def r(x: float) -> float:
        return x if digits is None else round(x, digits)

    for name, steps in totals.items():
        per = {k: (c / n, w / n, n) if n else (0.0, 0.0, 0) for k, (c, w, n) in steps.items()}
        out[name] = {
            "cpu_ms_per_item": r(sum(c for c, _, _ in per.values())),
            "wall_ms_per_item": r(sum(w for _, w, _ in per.values())),
            "items": max((n for _, _, n in per.values()), default=0),
            "steps": {
                k: {"cpu_ms": r(c), "wall_ms": r(w), "calls": n} for k, (c, w, n) in per.items()
            },
        }
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nicoffload-agent", description="The nicoffload DPU agent daemon."
    )
    p.add_argument("--config", help="TOML file (see agent.example.toml); flags override it")
    p.add_argument("--listen", help="HOST:PORT to listen on (default 127.0.0.1:7070; port 0: any)")
    p.add_argument("--token-file", help="file holding the shared secret (mode 600)")
    p.add_argument("--cores", type=int, help="pin to N cores and run N workers")
    p.add_argument(
        "--worker-processes",
        choices=["auto", "on", "off"],
        help="run the kernels in one process per core (on), in threads (off), or in processes "
        "from 4 cores on (auto, the default)",
    )
    p.add_argument("--metrics", help="HOST:PORT of the Prometheus endpoint (loopback by default)")
    p.add_argument(
        "--metrics-remote",
        action="store_true",
        default=None,
        help="allow --metrics on an address other than loopback",
    )
    p.add_argument("--metrics-token-file", help="scrapes must send this token as a Bearer token")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def pin_cores(n: int) -> list[int]:
    """Restrict this process to the first `n` cores it may run on (a DPU's core share)."""
    allowed = sorted(os.sched_getaffinity(0))
    if n > len(allowed):
        raise UserError(f"--cores {n}: only {len(allowed)} cores are available")
    os.sched_setaffinity(0, allowed[:n])
    return allowed[:n]


PARENT_ENV = "NICOFFLOAD_AGENT_PARENT"  # the pid of the host that started a local agent


def _stop_with_parent(agent: Agent) -> None:
    """A local agent (the emulated DPU `LocalAgent` starts) stops when the host that started
    it is gone, however it went (SIGKILL too): it would serve no one, for ever."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(0.5)
        log_event(log, logging.WARNING, "parent_gone", parent=int(parent))
        agent.request_stop()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config).replace(
            listen=args.listen,
            token_file=args.token_file,
            cores=args.cores,
            worker_processes=args.worker_processes,
            metrics=args.metrics,
            metrics_remote=args.metrics_remote,
            metrics_token_file=args.metrics_token_file,
            log_level=args.log_level,
        )
        logs.setup(cfg.log_level)
        if not cfg.token_file:
            raise UserError("no token file: give --token-file FILE (or token_file in --config)")
        token = auth.read_token(cfg.token_file)
        cores = pin_cores(cfg.cores) if cfg.cores else sorted(os.sched_getaffinity(0))
        agent = Agent(cfg, token)
    except UserError as exc:
        print(f"nicoffload-agent: {exc}", file=sys.stderr)
        return 2
    except NicoffloadError as exc:
        print(f"nicoffload-agent: {exc}", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.request_stop())
    _stop_with_parent(agent)
    line = {"event": "listening", "address": agent.address, "cores": cores}
    if agent.metrics_address:
        line["metrics"] = agent.metrics_address
    print(json.dumps(line), flush=True)
    log_event(log, logging.INFO, "listening", address=agent.address, cores=cores, pid=os.getpid())
    return agent.serve()


if __name__ == "__main__":
    sys.exit(main())
