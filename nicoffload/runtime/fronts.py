"""Opening the agent fronts of a plan's DPU stages: one connection (one agent session) and one
receiver per stage, so several stages on one DPU share its agent, each with a session of its
own. An emulated DPU's agent is started once, with every tokenizer its stages read.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import AgentError, DeviceError, Mark, UserError
from nicoffload.graph import Pipeline
from nicoffload.planner.physical import leaving
from nicoffload.planner.plan import Plan, StagePlan
from nicoffload.runtime.loadtext import load_text
from nicoffload.runtime.remote import RemoteFront, cores_apart
from nicoffload.topology import Device


@dataclass(frozen=True)
class Wanted:
    """A DPU stage to open a front for: its device, the transport its outputs come back over,
    the receiver's ring slots, and `gpu` (a `GpuDevice`) when they go straight to a GPU stage."""

    stage: StagePlan
    device: Device
    transport: str = "tcp"
    slots: int = 4
    gpu: Any = None


@dataclass
class _Agent:
    """A DPU's agent: where it listens and its token; an emulated one's process, the clients
    reached it (it is killed, not drained, when one found it dead), or why it died starting."""

    device: Device
    address: str = ""
    token: bytes = b""
    token_file: str | Path | None = None
    died: str | None = None
    reached: list[Any] = field(default_factory=list)


@contextlib.contextmanager
def open_fronts(
    pipeline: Pipeline,
    plan: Plan,
    wanted: Sequence[Wanted],
    *,
    token_file: str | Path | None = None,
) -> Iterator[dict[str, RemoteFront]]:
    """A front for each of `wanted`'s stages, by stage name: reach each device's agent (start
    one on loopback when the device is emulated), load the stage on its own connection, and
    listen for what it forwards. Everything is closed on the way out.

    `gpu`: the stage's outputs are landed in that GPU's memory as they arrive (`GpuLanding`):
    over rdma the receiver's ring is GPU memory itself where GPUDirect is possible
    (`rdma://...?gpu=N`), otherwise, and over shm and tcp, the receiver's host ring is
    page-locked and each batch copied to the GPU asynchronously."""
    from nicoffload.planner import physical

    # sized for this pipeline's batch (DeviceError, before any agent starts, when it cannot fit)
    sizes = {
        w.stage.name: int(physical.stage_physical(pipeline, plan, w.stage, None)["slot_bytes"])
        for w in wanted
    }
    rdma = {w.stage.name: _rdma_device(w) for w in wanted if w.transport == "rdma"}
    with contextlib.ExitStack() as stack:
        agents: dict[str, _Agent] = {}
        texts: dict[str, str] = {}
        for dev in dict.fromkeys(w.device.id for w in wanted):
            mine = [w for w in wanted if w.device.id == dev]
            device = mine[0].device
            folder = None
            if device.emulated:
                folder = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="nicoffload-"))
                )
            tokenizers = None
            for w in mine:
                texts[w.stage.name], found = load_text(pipeline, w.stage, folder)
                tokenizers = tokenizers or found
            agents[dev] = _start(stack, device, token_file, folder, tokenizers)
        fronts = {
            w.stage.name: _front(
                stack,
                pipeline,
                plan,
                w,
                agents[w.device.id],
                texts[w.stage.name],
                sizes[w.stage.name],
                rdma.get(w.stage.name),
            )
            for w in wanted
        }
        yield fronts


def _rdma_device(w: Wanted) -> str:
    """Before any agent starts: no RDMA device is a clear failure."""
    from nicoffload.transport import verbs

    try:
        return verbs.pick_device(None)
    except DeviceError as exc:
        raise DeviceError(
            f"{w.device.id}: the plan moves stage '{w.stage.name}' outputs over rdma, but {exc}"
        ) from exc


def _front(
    stack: contextlib.ExitStack,
    pipeline: Pipeline,
    plan: Plan,
    w: Wanted,
    agent: _Agent,
    text: str,
    slot_bytes: int,
    rdma_device: str | None,
) -> RemoteFront:
    """One stage's front: its own connection, receiver (and landing), the stage loaded."""
    from nicoffload.transport import listen

    stage, device = w.stage, w.device
    if agent.died is not None:
        return RemoteFront.gone(stage, f"the local agent died while it started: {agent.died}")
    try:
        client = _connect(stack, agent)
    except _Died as exc:
        return RemoteFront.gone(stage, f"the local agent died while it started: {exc}")
    on_gpu = "" if w.gpu is None else f"&gpu={w.gpu.device.index or 0}"
    where = {
        "shm": f"shm://nicoffload-{secrets.token_hex(6)}",
        "rdma": f"rdma://{client.local_host}:0?device={rdma_device}{on_gpu}",
    }.get(w.transport, f"tcp://{client.local_host}:0")
    # Only the agent's sender of this session holds the key: a stranger cannot attach first
    # nor inject a batch (every frame is checked against its MAC; over tcp, payloads too).
    rx = stack.enter_context(
        listen(where, slots=w.slots, slot_bytes=slot_bytes, key=client.forward_key)
    )
    landing = destination = None
    if w.gpu is not None:
        from nicoffload.transport import gpudirect
        from nicoffload.transport.gpu_landing import GpuLanding

        destination = getattr(rx, "destination", None) or gpudirect.Destination(
            gpudirect.PINNED, gpudirect.host_ring_reason(w.transport)
        )
        landing = stack.enter_context(GpuLanding(rx, w.gpu))  # closed before the receiver
    try:
        client.load(
            text,
            plan,
            stage.name,
            rx.address,
            batch_max_size=pipeline.batch_max_size,
            batch_max_wait_ms=pipeline.batch_max_wait_ms,
        )
    except AgentError as exc:
        if client.alive:  # the agent answered: it refuses the stage
            raise DeviceError(
                f"{device.id}: the agent did not load stage '{stage.name}': {exc}"
            ) from exc
        return RemoteFront.gone(stage, f"the agent died while it loaded the stage: {exc}")
    return RemoteFront(stage, client, rx, leaving(pipeline, stage), landing, destination)


class _Died(Exception):
    """The emulated DPU's agent died before it could be reached."""


def _start(
    stack: contextlib.ExitStack,
    device: Device,
    token_file: str | Path | None,
    folder: Path | None,
    tokenizers: Path | None,
) -> _Agent:
    """`device`'s agent: an emulated one is started, in `folder`, with `tokenizers` as its
    tokenizer_dir (see `loadtext`). A missing or unreadable token is the user's mistake."""
    from nicoffload.agent import auth
    from nicoffload.agent.local import LocalAgent

    if not device.emulated:
        if token_file is None:
            raise UserError(
                f"{device.id}: the agent at {device.address} needs its token: pass --token-file"
            )
        token = auth.read_token(token_file)  # UserError: missing, unreadable, too open, short
        return _Agent(device, device.address or "", token, token_file)
    assert folder is not None
    token_file = folder / "agent.token"
    auth.write_token(token_file)
    config = None
    if tokenizers is not None:
        config = folder / "agent.toml"
        config.write_text(f"tokenizer_dir = {json.dumps(str(tokenizers))}\n")
    try:
        local = stack.enter_context(LocalAgent(token_file, cores=device.cores, config=config))
    except AgentError as exc:
        return _Agent(device, died=str(exc))
    agent = _Agent(device, local.address, auth.read_token(token_file), token_file)
    # an agent found dead (or hung: SIGSTOP) is killed at once, not asked to drain, which
    # would wait its whole stop timeout for an answer that cannot come
    stack.callback(lambda: any(c.failed is not None for c in agent.reached) and local.kill())
    stack.enter_context(cores_apart(local.cores))
    return agent


def _connect(stack: contextlib.ExitStack, agent: _Agent) -> Any:
    """An authenticated AgentClient of its own to `agent` (closed with `stack`). A token the
    agent refuses is the user's mistake (UserError); a real agent that does not answer is a
    DeviceError; an emulated one that dies on the way is `_Died` (failover)."""
    from nicoffload.agent.client import AgentClient

    device = agent.device
    try:
        client = AgentClient(agent.address, agent.token)
    except (AgentError, OSError) as exc:
        if device.emulated:
            raise _Died(str(exc)) from exc
        if "authentication failed" in str(exc):
            raise UserError(
                f"the agent of {device.id} at {agent.address} refused this token: {exc}",
                Mark(str(agent.token_file), 1, 1),
            ) from None
        raise DeviceError(
            f"{device.id}: cannot reach the DPU agent at {agent.address}: {exc}"
        ) from exc
    if device.emulated:
        agent.reached.append(client)
    return stack.enter_context(client)
