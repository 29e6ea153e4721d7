"""The agent's ingress on one connection: a REQUEST frame (a batch of items back to back) is
checked whole against its header before a byte of its payload is read, read within the
client's memory budget, and admitted to the session as a batch; an item whose values are wrong
fails alone (`bad_request`), a frame that lies is a frame error. Mixed into `Connection`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_agents import budget
from dpu_agents.session import Item, Session
from dpu_agents.stageinputs import StageInput, check_kinds, check_tensors, tensor_inputs
from nicoffload.agent.protocol import (
    BYTES,
    MAX_INPUTS,
    MAX_NDIM,
    MAX_SHAPE_DIMS,
    MAX_VALUES,
    TENSOR,
    RequestMeta,
    request_sizes,
    split_request,
)
from nicoffload.errors import AgentError, FrameError
from nicoffload.transport.frame import DType, Header, decode_meta, encode_meta


class Ingress:
    """REQUEST handling of a `Connection` (which has the session, config, account, budget,
    window count and payload reader these methods use)."""

    session: Session | None
    cfg: Any
    account: budget.Account
    agent: Any
    _lock: Any
    _outstanding: int

    if TYPE_CHECKING:  # the Connection's own

        def _payload(self, header: Header, limit: int, keep: bool = True) -> memoryview: ...

        def _credit(self, n: int) -> None: ...

    def _request(self, header: Header, blob: bytes) -> None:
        meta = decode_meta(blob, RequestMeta)
        session = self.session
        if session is None:
            raise FrameError("malformed frame: kind: REQUEST before LOAD")
        sizes = request_sizes(header, meta)  # every length checked before a byte is read
        with self._lock:
            self._outstanding += 1
            if self._outstanding > self.cfg.window:
                raise FrameError(
                    f"malformed frame: kind: REQUEST without credit ({self.cfg.window})"
                )
        session.reading(1)
        try:
            self._frame(session, header, meta, sizes)
        finally:
            session.reading(-1)

    def _frame(
        self, session: Session, header: Header, meta: RequestMeta, sizes: np.ndarray
    ) -> None:
        n = header.payload_len
        # In the budget before a byte of it is read; over it, this socket is not read
        # (backpressure) until forwarded requests give memory back. Only a frame that no
        # wait could fit is refused, its items failing as too_large (the client sends frames
        # of at most WELCOME's max_request_bytes, and an item larger as `refused`: unsent).
        if meta.refused:
            reject = self._kept(meta.refused)
        else:
            reject = _over(self.account, budget.QUEUED, n, "a REQUEST frame's payload")
        queued = n if not reject[0] and n <= self.cfg.max_request_bytes else 0
        self.account.reserve(budget.QUEUED, queued, self.cfg.forward_timeout_s)
        payload = self._payload(header, self.cfg.max_request_bytes, keep=not reject[0])
        self.agent.metrics.request(n, len(sizes))
        fresh = session.fresh(header.request_id, len(sizes))
        items = self._items(session, header.request_id, meta, sizes, payload, fresh, reject)
        del payload  # what the items' values view stays alive with them
        if not any(it.values is not None for it in items):
            self.account.release(budget.QUEUED, queued)
            queued = 0
        if not items:  # every id was seen before
            self._credit(1)
            return
        # The frame's payload is one buffer the items view: it is given back with the last.
        last = items[-1]
        last.cost = (queued, last.cost[1])
        self._admit(session, items)

    def _kept(self, n: int) -> tuple[str, str]:
        """The reject of an item of `n` bytes that its client did not send (over WELCOME's
        max_request_bytes: RequestMeta.refused); a claim that would have fit is a lie."""
        what = "the request (kept by the client)"
        reject = _over(self.account, budget.QUEUED, n, what)
        limit = self.cfg.max_request_bytes
        if reject[0]:
            return reject
        if n <= limit:
            raise FrameError(
                f"malformed frame: meta: refused: {n} bytes, within max_request_bytes ({limit})"
            )
        return (
            "too_large",
            f"{what} needs {n} bytes, more than the agent's max_request_bytes ({limit})",
        )

    def _items(
        self,
        session: Session,
        first: int,
        meta: RequestMeta,
        sizes: np.ndarray,
        payload: memoryview,
        fresh: list[bool],
        reject: tuple[str, str],
    ) -> list[Item]:
        """The frame's items not seen before, each with its values or why it is refused (an
        item's fault, not the frame's: the others go on)."""
        every = None if reject[0] else split_request(meta, sizes, payload)
        most = self.account.most(budget.DECODE)
        cost = session.decode_cost
        inputs = session.built.inputs
        tensors = tensor_inputs(inputs)
        draining = self.agent.draining
        shared = ""  # the items' keys and kinds are the frame's meta: checked once, on one
        if every:
            try:
                check_kinds(inputs, every[0])
            except ValueError as exc:
                shared = str(exc)
        items = []
        for i, new in enumerate(fresh):
            if not new:
                self.agent.metrics.duplicate()
                continue
            why, values, decode = reject, None, 0
            if every is not None:
                values = every[i]
                try:
                    if shared:
                        raise ValueError(shared)
                    check_tensors(tensors, values)
                    decode = cost(values)
                    if decode > most:  # no wait could fit it: _over says why
                        why = _over(self.account, budget.DECODE, decode)
                except ValueError as exc:
                    why = ("bad_request", str(exc))
                if why[0]:
                    values, decode = None, 0
                elif draining:
                    values, why, decode = None, ("agent_draining", "the agent is shutting down"), 0
            items.append(Item(first + i, values, why, (0, decode)))
        return items

    def _admit(self, session: Session, items: list[Item]) -> None:
        """Admit a frame's items: as one piece when their decode memory fits the budget at
        once, else in pieces that each wait for theirs (an admitted piece runs meanwhile and
        gives its memory back: no wait closes a cycle). Never before the frame's MAC held."""
        most = self.account.most(budget.DECODE)
        piece: list[Item] = []
        used = 0
        for it in items:
            if piece and used + it.cost[1] > most:
                self._admit_piece(session, piece, used, last=False)
                piece, used = [], 0
            piece.append(it)
            used += it.cost[1]
        self._admit_piece(session, piece, used, last=True)

    def _admit_piece(self, session: Session, piece: list[Item], decode: int, last: bool) -> None:
        self.account.reserve(budget.DECODE, decode, self.cfg.forward_timeout_s)
        if not session.admit(piece, last):  # the session closed
            self.account.release(budget.QUEUED, sum(it.cost[0] for it in piece))
            self.account.release(budget.DECODE, decode)
            if last:
                self._credit(1)


def _over(account: budget.Account, kind: str, n: int, what: str = "") -> tuple[str, str]:
    """The reject of an item whose `n` bytes of `kind` no wait could ever fit, else ('', '')."""
    most = account.most(kind)
    if n <= most:
        return "", ""
    what = what or "decoding this request's images"
    return "too_large", f"{what} needs {n} bytes, more than the agent's {kind} budget ({most})"


def check_requests_fit(inputs: Mapping[str, StageInput]) -> None:
    """At LOAD, not per item: a stage whose requests the wire format cannot carry (too many
    inputs, or names too long for the metadata) would have every item refused."""
    if len(inputs) > MAX_INPUTS:
        raise AgentError(
            f"the stage reads {len(inputs)} inputs; a request carries at most {MAX_INPUTS}"
        )
    k = max(1, len(inputs))
    tensor = [i.kind == "tensor" for i in inputs.values()]
    ndims = tuple(len(i.spec.shape) if i.kind == "tensor" else 0 for i in inputs.values())
    if max(ndims, default=0) > MAX_NDIM:
        raise AgentError(f"a value of the stage's inputs has more than {MAX_NDIM} dims")
    dims = sum(ndims)
    n = min(MAX_VALUES // k, MAX_SHAPE_DIMS // dims if dims else MAX_VALUES)  # the most items
    meta = RequestMeta(
        tuple(inputs),
        tuple(TENSOR if t else BYTES for t in tensor),
        tuple(int(DType.FLOAT64) if t else 0 for t in tensor),
        ndims,
        bytes(4 * n * len(inputs)),
        bytes(4 * n * dims),
    )
    try:
        encode_meta(meta)
    except ValueError as exc:
        raise AgentError(f"a request of this stage's {len(inputs)} inputs: {exc}") from None
