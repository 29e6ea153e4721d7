"""The HTTP endpoint of `nicoffload serve`: an aiohttp app speaking the Open Inference Protocol
(KServe v2 REST + Triton's binary tensors) in front of a `Batcher`.

    GET  /v2/health/live   /v2/health/ready      open (no token): for load balancers and probes
    GET  /v2   /v2/models/{name}   /v2/models/{name}/ready
    POST /v2/models/{name}/infer

Every path but the two health probes needs `Authorization: Bearer <token>` when a token is set
(401 otherwise). A request is refused before its body is read when its Content-Length passes
the limit (413); aiohttp's `client_max_size` bounds a body sent without one. `drain()` (SIGTERM)
turns readiness off, answers 503 to new requests and returns once the ones in flight are
answered.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from aiohttp import web

from nicoffload.graph import Pipeline
from nicoffload.serve import kserve, kserve_out
from nicoffload.serve.batcher import Batcher, Outcome, Pending, QueueFull, refusal
from nicoffload.serve.clock import clock_id, now_ns
from nicoffload.serve.kserve import RequestError

log = logging.getLogger("nicoffload.serve")
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")
# Parsing a request and encoding a response run on the event loop when they are this small and
# binary (tens of microseconds: a handoff to a thread and back costs more, and on busy cores
# each of its wakeups can wait milliseconds, which set serving's tail); larger ones and JSON
# tensors go to a thread, so that one costly request does not hold up the others.
INLINE_BYTES = 1 << 20
# A response body this large goes out apart from its headers (`_send_apart`); a smaller one
# with them, in one write
APART_BYTES = 64 << 10
TIMEOUT_HEADER = "Nicoffload-Timeout-Us"  # the request's deadline, as Triton's `timeout` parameter


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    token: str | None = None
    max_request_bytes: int = 64 << 20
    read_timeout_s: float = 30.0
    version: str = "0.1.0"


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.Response(
        status=status,
        body=kserve_out.error_body(message),
        content_type="application/json",
        headers=headers,
    )


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=json.dumps(doc).encode(), content_type="application/json"
    )


class Server:
    """The app and its state: readiness, draining, requests in flight."""

    def __init__(
        self,
        pipeline: Pipeline,
        batcher: Batcher,
        config: ServeConfig,
        outputs: list[dict[str, Any]] | None = None,
    ) -> None:
        self.pipeline, self.batcher, self.config = pipeline, batcher, config
        self.metadata = kserve_out.model_metadata(config.model_name, pipeline, outputs)
        self.output_names = [o["name"] for o in self.metadata["outputs"]]
        self.draining = False
        self.clock = clock_id()
        self.in_flight = 0  # infer handlers between their first line and their response
        self._idle = asyncio.Event()
        self._idle.set()
        self.app = web.Application(
            middlewares=[self._auth], client_max_size=config.max_request_bytes
        )
        name = "/v2/models/{name}"
        self.app.add_routes(
            [
                web.get("/v2/health/live", self.live),
                web.get("/v2/health/ready", self.ready),
                web.get("/v2", self.server_metadata),
                web.get(name, self.model_metadata),
                web.get(name + "/ready", self.model_ready),
                web.post(name + "/infer", self.infer),
            ]
        )

    @property
    def is_ready(self) -> bool:
        return not self.draining and not self.batcher.ended.is_set()

    def refuse_token(self, given: str) -> str | None:
        """Why an `Authorization` value (HTTP header or gRPC metadata) is refused, or None
        when it carries the token (or no token is set)."""
        token = self.config.token
        if token is None:
            return None
        scheme, _, value = given.partition(" ")
        try:
            mine = value.strip().encode()
        except UnicodeEncodeError:  # a header's odd bytes (surrogates): no token of ours
            mine = b""
        if scheme.lower() == "bearer" and hmac.compare_digest(mine, token.encode()):
            return None
        return f"{'missing' if not given else 'wrong'} bearer token"

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            why = self.refuse_token(request.headers.get("Authorization", ""))
            if why is not None:
                return _error(401, why, **{"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        return _json({"ready": self.is_ready}, 200 if self.is_ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(
            {
                "name": "nicoffload",
                "version": self.config.version,
                "extensions": ["binary_tensor_data"],
            }
        )

    def unknown_model(self, name: str) -> str | None:
        """The 404's reason when `name` is not this server's model, else None."""
        if name != self.config.model_name:
            return f"unknown model '{name}' (this server has '{self.config.model_name}')"
        return None

    def _model(self, request: web.Request) -> web.Response | None:
        why = self.unknown_model(request.match_info["name"])
        return None if why is None else _error(404, why)

    async def model_metadata(self, request: web.Request) -> web.Response:
        return self._model(request) or _json(self.metadata)

    async def model_ready(self, request: web.Request) -> web.Response:
        return self._model(request) or _json(
            {"name": self.config.model_name, "ready": self.is_ready}, 200 if self.is_ready else 503
        )

    async def answer(
        self, model: str, read: Callable[[], Awaitable[kserve.InferRequest]], arrived: float
    ) -> tuple[kserve.InferRequest | None, Outcome]:
        """One infer request, whatever the endpoint: the model and readiness checked, the
        request read (`read`: parsed into an InferRequest, or RequestError), checked against
        the pipeline, queued with its deadline and awaited. The request (None when it was not
        read) and its Outcome; a refusal is an Outcome too (503 with `retry` when the queue is
        full)."""
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._answer(model, read, arrived)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _answer(
        self, model: str, read: Callable[[], Awaitable[kserve.InferRequest]], arrived: float
    ) -> tuple[kserve.InferRequest | None, Outcome]:
        if (why := self.unknown_model(model)) is not None:
            return None, Outcome(404, error=why)
        if not self.is_ready:
            why = "draining (shutting down)" if self.draining else "the pipeline has stopped"
            return None, Outcome(503, error=f"server not ready: {why}")
        req = None
        try:
            req = await read()
            timeout_us = req.timeout_us  # a bad one is refused here, before anything is queued
            kserve.check_outputs(req, self.output_names)
            items = kserve.items_of(req, self.pipeline)
            kserve.check_json_outputs(req, self.metadata["outputs"], len(items))
        except RequestError as exc:
            return req, Outcome(exc.status, error=exc.message)
        deadline = None if timeout_us is None else arrived + timeout_us / 1e6
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()
        done: asyncio.Future[Outcome] = loop.create_future()

        def settle(outcome: Outcome) -> None:
            if not done.done():
                done.set_result(outcome)
            elif outcome.release is not None:  # its handler is gone (cancelled): nobody will
                outcome.release()

        def on_done(outcome: Outcome) -> None:
            if threading.get_ident() == loop_thread:  # a front's answer, read on its loop
                settle(outcome)
            else:  # the batcher's thread (serve without --fronts)
                loop.call_soon_threadsafe(settle, outcome)

        pending = Pending(items, on_done, arrived, time.perf_counter(), deadline)
        try:
            self.batcher.submit(pending)
        except (QueueFull, RequestError, RuntimeError) as exc:
            return req, refusal(exc)
        return req, await done

    async def infer(self, request: web.Request) -> web.StreamResponse:
        arrived, arrived_ns = time.perf_counter(), now_ns()
        req, outcome = await self.answer(
            request.match_info["name"], lambda: self._read(request), arrived
        )
        resumed = time.perf_counter()
        if req is None or outcome.outputs is None:
            doc: dict[str, Any] = {"error": outcome.error}
            if outcome.timings:
                doc["parameters"] = dict(outcome.timings)
            if req is not None and req.id is not None:
                doc["id"] = req.id
            response = _json(doc, outcome.status)
            if outcome.retry:
                response.headers["Retry-After"] = "1"
            return response
        names = kserve_out.answered_outputs(req, outcome.outputs)
        binary = req.binary_output or all((req.outputs or {}).get(k) for k in names)
        size = sum(np.asarray(outcome.outputs[k]).nbytes for k in names)
        model = self.config.model_name
        try:
            if binary and size <= INLINE_BYTES:  # views of the outputs, copied once into the body
                parts = kserve_out.response_parts(model, req, outcome.outputs, copy=False)
            else:  # off the event loop: encoding a large response must not hold up the others
                parts = await asyncio.get_running_loop().run_in_executor(
                    None, kserve_out.response_parts, model, req, outcome.outputs
                )
            params = self.timings(outcome, arrived, arrived_ns, resumed, time.perf_counter())
            body, headers = kserve_out.assemble_response(parts, params)
        finally:  # the body is a copy: what the outputs point into is free again
            if outcome.release is not None:
                outcome.release()
        if len(body) < APART_BYTES:
            return web.Response(body=body, headers=headers)
        return await _send_apart(request, body, headers)

    def timings(
        self, outcome: Outcome, arrived: float, arrived_ns: int, resumed: float, encoded: float
    ) -> dict[str, Any]:
        """A response's timing parameters, whatever the endpoint: the batcher's parts, which
        end when it decided, then the handler's: back on the event loop (`resume`), the outputs
        encoded (`encode`); `server_us` ends at `encoded`, as the response is handed to the
        HTTP or gRPC library. `arrived_ns` on `clock` lets a client on this kernel measure the
        way here and back (loadgen's request_us and response_us)."""
        params: dict[str, Any] = dict(outcome.timings)
        params["resume_us"] = max(0, round((resumed - outcome.decided) * 1e6))
        params["encode_us"] = round((encoded - resumed) * 1e6)
        params["server_us"] = round((encoded - arrived) * 1e6)
        params["arrived_ns"] = arrived_ns
        if self.clock:
            params["clock"] = self.clock
        return params

    async def _read(self, request: web.Request) -> kserve.InferRequest:
        """The HTTP request's body read and parsed, with its timeout header."""
        limit = self.config.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(
                f"request of {request.content_length} bytes, more than the limit of {limit}", 413
            )
        try:  # a timer, not wait_for's task per request
            async with asyncio.timeout(self.config.read_timeout_s):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"request body over the limit of {limit} bytes", 413) from None
        except TimeoutError:
            raise RequestError(
                f"the body did not arrive within {self.config.read_timeout_s:g} s", 408
            ) from None
        except Exception as exc:  # aiohttp's payload errors: the body ended early
            raise RequestError(f"truncated body: {type(exc).__name__}: {exc}") from None
        args = (
            body,
            request.headers.get("Content-Type", ""),
            request.headers.get(kserve.HEADER_LENGTH),
            self.batcher.max_queue,
        )
        if _small_binary(body, args[2]):
            req = kserve.parse_infer(*args)
        else:  # off the event loop (a request of many elements takes a while to read)
            req = await asyncio.get_running_loop().run_in_executor(None, kserve.parse_infer, *args)
        if TIMEOUT_HEADER in request.headers:
            try:
                t = int(request.headers[TIMEOUT_HEADER][:40])
            except ValueError:
                raise RequestError(
                    f"{TIMEOUT_HEADER} must be a whole number of microseconds"
                ) from None
            req = with_timeout(req, t)
        return req

    async def drain(self) -> None:
        """Stop taking requests (readiness off, 503) and wait until those in flight are
        answered."""
        if not self.draining:
            log.info("draining: %d requests in flight", self.in_flight)
        self.draining = True
        await self._idle.wait()


async def _send_apart(
    request: web.Request, body: bytes, headers: dict[str, str]
) -> web.StreamResponse:
    """A large body written as it is, its headers in a write of their own: aiohttp (3.12 and
    later, on Python before 3.12.9) joins the headers and the body of a `web.Response` into
    one new bytes, an allocation and a copy of the whole answer per request."""
    response = web.StreamResponse(headers=headers)
    response.content_length = len(body)
    writer = await response.prepare(request)
    send_headers = getattr(writer, "send_headers", None)  # before 3.12 prepare sent them
    if send_headers is not None:
        send_headers()
    await response.write(body)
    await response.write_eof()
    return response


def _small_binary(body: bytes, header_length: str | None) -> bool:
    """A binary request small enough to parse on the event loop: a JSON head of at most 64 KiB
    (what costs time is JSON, not the binary part, which is sliced), INLINE_BYTES in all."""
    if header_length is None or len(body) > INLINE_BYTES:
        return False
    try:
        return 0 <= int(header_length[:20]) <= 64 << 10
    except ValueError:
        return False  # parse_infer says what is wrong with it, off the loop as before


def with_timeout(req: kserve.InferRequest, timeout_us: int) -> kserve.InferRequest:
    """A deadline from outside the request (a header, gRPC's deadline), the tighter of the two
    when the request has a `timeout` too."""
    mine = req.timeout_us
    t = timeout_us if mine is None or (0 < timeout_us < mine) else mine
    return replace(req, parameters={**req.parameters, "timeout": t})
