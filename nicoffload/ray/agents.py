"""DPU agents as Ray actors: each one starts `nicoffload-agent` (`python -m dpu_agents.server`,
as `LocalAgent` does) on the node its label selector names, listening on that node's address;
Ray restarts it (`max_restarts`) when it dies, and the actor dies when its agent does so that
Ray does. Ray carries the descriptors (address, pid) and the token, never a tensor: the
Session reaches each agent over our own transports.

    with AgentFleet(cluster, ["dpu0"]) as fleet:
        prep = fleet.attach(prep)     # the topology's agent devices get their addresses
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray

from nicoffload.errors import DeviceError, UserError
from nicoffload.ray.topology import AGENT_PORT, NODE_ID, ROLE, ClusterTopology
from nicoffload.topology import Topology

MAX_RESTARTS = 3  # per agent actor; a node that keeps killing its agent is not retried for ever
START_TIMEOUT_S = 120.0  # an actor waits for its node's resources (and its agent to listen)
WATCH_S = 0.2  # how often an actor checks that its agent lives


def _write_token(path: Path, token: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(token + b"\n")


@ray.remote(num_cpus=0, max_restarts=MAX_RESTARTS, max_task_retries=0)
class AgentActor:
    """One DPU agent process on this actor's node; constructed again by Ray on a restart."""

    def __init__(self, token: bytes, cores: int | None) -> None:
        from nicoffload.agent.local import LocalAgent

        # one folder per actor, made anew by each incarnation: a restart after a crash (which
        # cleans nothing up) leaves no stale token file behind it on the node
        actor_id = ray.get_runtime_context().get_actor_id()
        self.folder = Path(tempfile.gettempdir()) / f"nicoffload-ray-agent-{actor_id}"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(mode=0o700)
        token_file = self.folder / "agent.token"
        _write_token(token_file, token)
        host = ray.util.get_node_ip_address()
        # the agent's PARENT_ENV is this actor's pid: it stops when the actor dies, however
        self.agent = LocalAgent(token_file, listen=f"{host}:0", cores=cores)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.stopping = False
        threading.Thread(target=self._watch, name="agent-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            if not self.agent.alive():
                os._exit(1)  # the agent died under us: Ray restarts this actor, and so the agent
            time.sleep(WATCH_S)

    def descriptor(self) -> dict[str, Any]:
        return {
            "address": self.agent.address,
            "pid": self.agent.pid,
            "node_id": ray.get_runtime_context().get_node_id(),
            "restarted": self.restarted,
            "actor_id": ray.get_runtime_context().get_actor_id(),
        }

    def stop(self) -> int:
        self.stopping = True
        code = self.agent.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
        return code


class AgentFleet:
    """The agent actors of some of a cluster topology's devices, and the token file the host
    reaches them with: one token for the fleet, `token_file`'s when given (it must be, when a
    device's agent is attached: one already running there, `nicoffload.io/agent-port`), else a
    new one in a private folder of this process. Attached agents are reached, not started.
    `close()` drains and stops every agent started and ends its actor."""

    def __init__(
        self, cluster: ClusterTopology, devices: Iterable[str], token_file: str | Path | None = None
    ) -> None:
        from nicoffload.agent import auth

        self.cluster = cluster
        self.folder = Path(tempfile.mkdtemp(prefix="nicoffload-ray-"))
        self.actors: dict[str, Any] = {}
        wanted = list(dict.fromkeys(devices))
        attached = {
            d: cluster.topology.device(d).address for d in wanted if d in cluster.agent_nodes
        }
        attached = {d: a for d, a in attached.items() if a}
        if token_file is not None:
            self.token_file = Path(token_file)
            token = auth.read_token(token_file)  # UserError: missing, unreadable, too open
        elif attached:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise UserError(
                f"{', '.join(attached)}: an agent already runs there ({AGENT_PORT}): pass the "
                "--token-file it was started with"
            )
        else:
            self.token_file = self.folder / "fleet.token"
            token = auth.write_token(self.token_file)
        self.attached = {d: {"address": a, "attached": True} for d, a in attached.items()}
        try:
            for dev in (d for d in wanted if d not in attached):
                if dev not in cluster.agent_nodes:
                    raise DeviceError(
                        f"{dev}: not an agent device of topology '{cluster.topology.name}' "
                        f"(those are {', '.join(cluster.agent_nodes) or 'none'})"
                    )
                node = cluster.agent_nodes[dev]
                cores = cluster.topology.device(dev).cores
                # the node's role and its id: a restart lands on that node or nowhere; the
                # cores its workers run on are Ray's to count, so nothing else is put there
                selector = {ROLE: str(node.role), NODE_ID: node.id}
                self.actors[dev] = AgentActor.options(
                    label_selector=selector, num_cpus=cores
                ).remote(token, cores)
            self.descriptors = self.refresh()
        except BaseException:
            self.close()
            raise

    def refresh(self, timeout: float = START_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        """Each agent's descriptor, asked now: after a restart, its new address and pid (an
        actor Ray is restarting is asked again until `timeout`)."""
        deadline = time.monotonic() + timeout
        out = {}
        for dev, actor in self.actors.items():
            while True:
                left = max(0.1, deadline - time.monotonic())
                try:
                    out[dev] = ray.get(actor.descriptor.remote(), timeout=left)
                    break
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise DeviceError(f"{dev}: its agent actor is still restarting") from None
                    time.sleep(WATCH_S)
                except (ray.exceptions.RayError, TimeoutError) as exc:
                    raise DeviceError(f"{dev}: its agent actor did not start: {exc}") from exc
        self.descriptors = {**self.attached, **out}
        return self.descriptors

    def topology(self) -> Topology:
        """The cluster topology with each of this fleet's agents' current address."""
        topo = self.cluster.topology
        devices = tuple(
            dataclasses.replace(d, address=self.descriptors[d.id]["address"])
            if d.id in self.descriptors
            else d
            for d in topo.devices
        )
        return dataclasses.replace(topo, devices=devices)

    def attach(self, prep: Any) -> Any:
        """`prep` (a runner.Prepared) to run on this fleet's agents."""
        return dataclasses.replace(prep, topology=self.topology(), token_file=self.token_file)

    def kill(self, device: str, restart: bool = True) -> None:
        """End `device`'s actor (and so its agent) at once; Ray restarts it when `restart`."""
        ray.kill(self.actors[device], no_restart=not restart)

    def close(self) -> None:
        for actor in self.actors.values():
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(actor.stop.remote(), timeout=60)
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(actor, no_restart=True)
        self.actors = {}
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> AgentFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
