"""The agent's Prometheus endpoint on a bounded server: it shares the agent's process, so it must
never take the agent's descriptors or threads.

prometheus_client's own server starts a thread per connection with no timeout; this one is
http.server with prometheus_client's handler, `limit` worker threads started once, at most
`limit` connections held (a new one displaces the oldest that has not yet sent a whole request;
if every one has, the new one is closed), each closed `timeout_s` after accept whatever it is
doing, and an accept that fails (EMFILE) backs off instead of spinning. Scrapes may have to
carry `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import select
import socket
import socketserver
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

from dpu_agents.logs import Tally

log = logging.getLogger("dpu_agents.metrics")
BACKOFF_S = (0.01, 1.0)
PEEK_BYTES = 4096  # a scrape's request, sent as it connects, is well under this


class _Handler(MetricsHandler):
    server: MetricsServer

    def setup(self) -> None:
        self.timeout = self.server.timeout_s  # per read and write (StreamRequestHandler)
        super().setup()

    def do_GET(self) -> None:
        self.server.serving(self.request)
        token = self.server.token
        if token is not None:
            got = self.headers.get("Authorization", "").encode("latin-1", "replace")
            if not hmac.compare_digest(got, b"Bearer " + token):
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="nicoffload-agent"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        super().do_GET()


class MetricsServer(socketserver.TCPServer):
    """`serve_forever()` on a thread of its own; `close()` stops it and its workers."""

    allow_reuse_address = True
    request_queue_size = 64  # the kernel's queue: no descriptor of ours until accepted

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        limit: int = 4,
        timeout_s: float = 5.0,
        token: bytes | None = None,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        handler = type("Handler", (_Handler,), {"registry": registry})
        super().__init__((host, port), handler)
        self.limit, self.timeout_s, self.token = limit, timeout_s, token
        self._lock = threading.Lock()
        self._held: dict[socket.socket, float] = {}  # -> when accepted; oldest first
        self._serving: set[socket.socket] = set()  # held, with their request read
        self._open = 0  # accepted and not yet closed, held or displaced
        self._queue: queue.SimpleQueue[tuple[socket.socket, Any] | None] = queue.SimpleQueue()
        self._backoff = BACKOFF_S[0]
        self._accept_errors = Tally(log, "metrics_accept_failed", level=logging.ERROR)
        self._workers: list[threading.Thread] = []
        try:
            for i in range(limit):
                t = threading.Thread(target=self._work, name=f"metrics-{i}", daemon=True)
                t.start()
                self._workers.append(t)
            threading.Thread(target=self.serve_forever, name="metrics", daemon=True).start()
        except BaseException:  # no thread: nothing may stay open
            for _ in self._workers:
                self._queue.put(None)
            self.server_close()
            raise

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            got = super().get_request()
        except OSError as exc:  # EMFILE: the listener stays readable, so wait before the next
            self._accept_errors.note(f"{type(exc).__name__}: {exc}")
            time.sleep(self._backoff)
            self._backoff = min(2 * self._backoff, BACKOFF_S[1])
            raise
        self._backoff = BACKOFF_S[0]
        return got

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            victim = None
            if len(self._held) >= self.limit:
                victim = next((s for s in self._held if self._silent(s)), None)
                if victim is None or self._open >= 3 * self.limit:
                    self.shutdown_request(request)
                    return
                del self._held[victim]
            self._held[request] = time.monotonic()
            self._open += 1
        if victim is not None:
            _wake(victim)
        self._queue.put((request, client_address))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception as exc:  # a peer gone mid-request, a timeout: not worth a line each
                log.debug("metrics request failed: %r", exc)
            finally:
                with self._lock:
                    self._held.pop(request, None)
                    self._serving.discard(request)
                    self._open -= 1
                self.shutdown_request(request)

    def service_actions(self) -> None:
        """Each turn of serve_forever: close what has been held too long, write due logs."""
        cutoff = time.monotonic() - self.timeout_s
        with self._lock:
            late = [s for s, since in self._held.items() if since < cutoff]
        for s in late:
            _wake(s)
        self._accept_errors.flush()

    def serving(self, sock: socket.socket) -> None:
        """The request on `sock` has been read: it is being answered, not displaced."""
        with self._lock:
            if sock in self._held:
                self._serving.add(sock)

    def _silent(self, sock: socket.socket) -> bool:
        """Neither being answered nor with a whole request waiting (a scraper sends it as it
        connects): what makes room for a newer connection."""
        return sock not in self._serving and not _sent_a_request(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        for _ in self._workers:
            self._queue.put(None)
        with self._lock:
            held = list(self._held)
        for s in held:
            _wake(s)
        for t in self._workers:
            t.join(self.timeout_s)
        self._accept_errors.flush(force=True)


def _sent_a_request(sock: socket.socket) -> bool:
    """Whether a whole request head is waiting to be read. Asks poll() first: a socket with a
    timeout (a worker's) would wait that long in recv() even with MSG_DONTWAIT."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    try:
        return bool(p.poll(0)) and b"\r\n\r\n" in sock.recv(PEEK_BYTES, socket.MSG_PEEK)
    except OSError:
        return False


def _wake(sock: socket.socket) -> None:
    """End the worker's wait on `sock` (it then closes it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
