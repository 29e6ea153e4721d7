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
import time
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from nicoffload.graph import Pipeline
from nicoffload.serving import kserve
from nicoffload.serving.batcher import Batcher, Outcome, Pending, QueueFull
from nicoffload.serving.kserve import RequestError

log = logging.getLogger("nicoffload.serve")
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")
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
        body=kserve.error_body(message),
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
        self.metadata = kserve.model_metadata(config.model_name, pipeline, outputs)
        self.output_names = [o["name"] for o in self.metadata["outputs"]]
        self.draining = False
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

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        token = self.config.token
        if token is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                value.strip().encode(), token.encode()
            ):
                why = "missing" if not given else "wrong"
                return _error(401, f"{why} bearer token", **{"WWW-Authenticate": "Bearer"})
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

    def _model(self, request: web.Request) -> web.Response | None:
        name = request.match_info["name"]
        if name != self.config.model_name:
            return _error(
                404, f"unknown model '{name}' (this server has '{self.config.model_name}')"
            )
        return None

    async def model_metadata(self, request: web.Request) -> web.Response:
        return self._model(request) or _json(self.metadata)

    async def model_ready(self, request: web.Request) -> web.Response:
        return self._model(request) or _json(
            {"name": self.config.model_name, "ready": self.is_ready}, 200 if self.is_ready else 503
        )

    async def infer(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._infer(request, arrived)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _infer(self, request: web.Request, arrived: float) -> web.StreamResponse:
        if (refused := self._model(request)) is not None:
            return refused
        if not self.is_ready:
            why = "draining (shutting down)" if self.draining else "the pipeline has stopped"
            return _error(503, f"server not ready: {why}")
        try:
            req, items, timeout_us = await self._read(request)
        except RequestError as exc:
            return _error(exc.status, exc.message)
        deadline = None if timeout_us is None else arrived + timeout_us / 1e6
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Outcome] = loop.create_future()

        def on_done(outcome: Outcome) -> None:  # on the batcher's thread
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(outcome))

        pending = Pending(items, on_done, arrived, time.perf_counter(), deadline)
        try:
            self.batcher.submit(pending)
        except QueueFull as exc:
            return _error(503, str(exc), **{"Retry-After": "1"})
        except RequestError as exc:
            return _error(exc.status, exc.message)
        except RuntimeError as exc:
            return _error(503, f"server not ready: {exc}")
        outcome = await done
        params: dict[str, Any] = dict(outcome.timings)
        if outcome.outputs is None:
            doc: dict[str, Any] = {"error": outcome.error, "parameters": params}
            if req.id is not None:
                doc["id"] = req.id
            return _json(doc, outcome.status)
        body, headers = kserve.infer_response(self.config.model_name, req, outcome.outputs, params)
        return web.Response(body=body, headers=headers)

    async def _read(
        self, request: web.Request
    ) -> tuple[kserve.InferRequest, list[dict[str, Any]], int | None]:
        """The request read, parsed and checked: it, its items and its timeout (us)."""
        limit = self.config.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(
                f"request of {request.content_length} bytes, more than the limit of {limit}", 413
            )
        try:
            body = await asyncio.wait_for(request.read(), self.config.read_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"request body over the limit of {limit} bytes", 413) from None
        except TimeoutError:
            raise RequestError(
                f"the body did not arrive within {self.config.read_timeout_s:g} s", 408
            ) from None
        except Exception as exc:  # aiohttp's payload errors: the body ended early
            raise RequestError(f"truncated body: {type(exc).__name__}: {exc}") from None
        req = kserve.parse_infer(
            body, request.headers.get("Content-Type", ""), request.headers.get(kserve.HEADER_LENGTH)
        )
        if TIMEOUT_HEADER in request.headers:
            try:
                t = int(request.headers[TIMEOUT_HEADER])
            except ValueError:
                raise RequestError(
                    f"{TIMEOUT_HEADER} must be a whole number of microseconds"
                ) from None
            req = _with_timeout(req, t)
        timeout_us = req.timeout_us  # a bad one is refused here, before anything is queued
        kserve.check_outputs(req, self.output_names)
        return req, kserve.items_of(req, self.pipeline), timeout_us

    async def drain(self) -> None:
        """Stop taking requests (readiness off, 503) and wait until those in flight are
        answered."""
        if not self.draining:
            log.info("draining: %d requests in flight", self.in_flight)
        self.draining = True
        await self._idle.wait()


def _with_timeout(req: kserve.InferRequest, timeout_us: int) -> kserve.InferRequest:
    """The header's deadline, the tighter of the two when the request has a `timeout` too."""
    mine = req.timeout_us
    t = timeout_us if mine is None or (0 < timeout_us < mine) else mine
    return replace(req, parameters={**req.parameters, "timeout": t})
