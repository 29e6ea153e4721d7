"""The gRPC endpoint of `nicoffload serve`: KServe v2's `GRPCInferenceService` (grpcio's asyncio
server, tritonclient[grpc]'s generated classes) beside the HTTP one, on the same `Server`: one
batcher, one readiness, one drain, one token, the same checks and the same reasons.

    ServerLive  ServerReady                  open (no token), as the HTTP health probes
    ServerMetadata  ModelMetadata  ModelReady  ModelInfer   need `authorization: Bearer <token>`

An HTTP status becomes a gRPC code (`CODE_OF_STATUS`; a full queue's 503 is RESOURCE_EXHAUSTED,
a draining server's UNAVAILABLE). The request's size is bounded by grpc's own max message size
(RESOURCE_EXHAUSTED past it); the call's gRPC deadline is its deadline, the tighter of it and
Triton's `timeout` parameter. A response carries the HTTP endpoint's timing parameters (the
per-request breakdown, `Server.timings`) as its parameters. The other RPCs of the service (statistics, repository, shared
memory, trace, logging) are not served: UNIMPLEMENTED, grpcio's default.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from nicoffload.serve import kserve_out, kserve_pb
from nicoffload.serve.batcher import Outcome
from nicoffload.serve.clock import now_ns
from nicoffload.serve.server import INLINE_BYTES, Server, with_timeout

S = grpc.StatusCode
CODE_OF_STATUS = {
    400: S.INVALID_ARGUMENT,
    401: S.UNAUTHENTICATED,
    404: S.NOT_FOUND,
    408: S.DEADLINE_EXCEEDED,
    413: S.RESOURCE_EXHAUSTED,
    415: S.INVALID_ARGUMENT,
    500: S.INTERNAL,
    503: S.UNAVAILABLE,
    504: S.DEADLINE_EXCEEDED,
}


def code_of(outcome: Outcome) -> grpc.StatusCode:
    if outcome.status == 503 and outcome.retry:
        return S.RESOURCE_EXHAUSTED  # the queue is full: retry later
    return CODE_OF_STATUS.get(outcome.status, S.UNKNOWN)


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The service's RPCs on a `Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        why = self.server.refuse_token(given if isinstance(given, str) else "")
        if why is not None:
            await context.abort(S.UNAUTHENTICATED, why)

    async def _model(self, name: str, context: grpc.aio.ServicerContext) -> None:
        await self._authorize(context)
        if (why := self.server.unknown_model(name)) is not None:
            await context.abort(S.NOT_FOUND, why)

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.server.is_ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        await self._authorize(context)
        return service_pb2.ServerMetadataResponse(
            name="nicoffload", version=self.server.config.version, extensions=[]
        )

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        await self._model(request.name, context)
        return kserve_pb.model_metadata(self.server.metadata)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        await self._model(request.name, context)
        return service_pb2.ModelReadyResponse(ready=self.server.is_ready)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        arrived, arrived_ns = time.perf_counter(), now_ns()
        await self._authorize(context)
        remaining = context.time_remaining()
        loop = asyncio.get_running_loop()

        async def read() -> kserve_pb.InferRequest:
            args = (request, self.server.batcher.max_queue)
            if request.ByteSize() <= INLINE_BYTES:  # as HTTP's: a thread hop costs more
                req = kserve_pb.infer_request(*args)
            else:
                req = await loop.run_in_executor(None, kserve_pb.infer_request, *args)
            if remaining is not None:  # the call's deadline, counted from its arrival
                req = with_timeout(req, max(1, int(remaining * 1e6)))
            return req

        req, outcome = await self.server.answer(request.model_name, read, arrived)
        resumed = time.perf_counter()
        if req is None or outcome.outputs is None:
            await context.abort(code_of(outcome), outcome.error or "")
        assert req is not None and outcome.outputs is not None
        args = (self.server.config.model_name, req, outcome.outputs)
        names = kserve_out.answered_outputs(req, outcome.outputs)
        try:
            if sum(np.asarray(outcome.outputs[k]).nbytes for k in names) <= INLINE_BYTES:
                resp = kserve_pb.infer_response(*args)
            else:  # off the event loop: encoding a large response must not hold up the others
                resp = await loop.run_in_executor(None, kserve_pb.infer_response, *args)
        finally:  # the response holds copies: a front's slot is free again
            if outcome.release is not None:
                outcome.release()
        # the same timing parameters as HTTP's (`Server.timings`): the breakdown over gRPC
        params = self.server.timings(outcome, arrived, arrived_ns, resumed, time.perf_counter())
        return kserve_pb.add_parameters(resp, params)


async def start(server: Server, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """The gRPC server started on host:port (0: a free port); it and the port bound.
    OSError when the address cannot be bound."""
    limit = server.config.max_request_bytes
    g = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", -1),
        ]
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(server), g)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = g.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises RuntimeError for an address it cannot bind
        raise OSError(f"cannot bind {address}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await g.start()
    return g, bound
