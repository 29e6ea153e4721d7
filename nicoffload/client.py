"""`Client`: run a whole pipeline on a DPU agent and get the outputs back in item order.

The outputs come back to a receiver this client listens on; the connection to the agent is an
`AgentClient` (`nicoffload.agent.client`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.errors import AgentError, TransportError
from nicoffload.graph import Pipeline, load_pipeline
from nicoffload.inputs import values_items
from nicoffload.planner.plan import Plan, single_device_plan
from nicoffload.runner import RunResult, RunStats
from nicoffload.runtime.executor import ItemFailure
from nicoffload.runtime.remote import failed_of
from nicoffload.transport import Delivery, listen
from nicoffload.transport.slots import ALIGN


class Client:
    """Runs whole pipelines on a DPU agent: `Client(address, token_file).run(pipeline, items)`.

    The outputs come back to a receiver this client listens on (TCP on the interface that
    reaches the agent, or shared memory with `transport="shm"` for a local agent).
    """

    def __init__(self, address: str, token_file: str | Path, *, timeout: float = 10.0) -> None:
        self.address, self.timeout = address, timeout
        self._token = auth.read_token(token_file)

    def stats(self) -> dict[str, Any]:
        with AgentClient(self.address, self._token, timeout=self.timeout) as agent:
            return agent.stats()

    def run(
        self,
        pipeline: Pipeline | str | Path,
        items: Iterable[Any],
        *,
        transport: str = "tcp",
        slots: int = 4,
        slot_bytes: int | None = None,
    ) -> RunResult:
        """Run every node of `pipeline` on the agent over `items` (as `nicoffload.run` takes
        them) and return the outputs in item order; failed items are reported, not raised."""
        if not isinstance(pipeline, Pipeline):
            pipeline = load_pipeline(pipeline)
        plan = single_device_plan(pipeline, "dpu0")
        keys = {name: str(ref) for name, ref in pipeline.outputs.items()}
        specs = pipeline.output_specs()
        batch = pipeline.batch_max_size
        if slot_bytes is None:  # every static output of a full batch; ragged ones at 4x typical
            slot_bytes = sum(
                -(-batch * (s.typical_nbytes * (1 if s.static else 4)) // ALIGN) * ALIGN
                + batch * ALIGN
                for s in specs.values()
            )
        stats, t0, cpu0 = (
            RunStats(placement=dict(plan.placement)),
            time.perf_counter(),
            time.process_time(),
        )
        with AgentClient(self.address, self._token, timeout=self.timeout) as agent:
            where = (
                f"shm://nicoffload-client-{secrets.token_hex(6)}"
                if transport == "shm"
                else f"tcp://{agent.local_host}:0"
            )
            with listen(where, slots=slots, slot_bytes=slot_bytes, key=agent.forward_key) as rx:
                agent.load(
                    Path(pipeline.path).read_text(encoding="utf-8"),
                    plan,
                    plan.stages[0].name,
                    rx.address,
                    batch_max_size=batch,
                    batch_max_wait_ms=pipeline.batch_max_wait_ms,
                )
                got = _Collector(keys)
                feeder = _Feeder(agent, values_items(pipeline, items))
                feeder.start()
                while not feeder.finished(got.count):
                    if not agent.alive:
                        agent.stats()  # raises the AgentError that killed it
                    try:
                        d = rx.recv(timeout=self.timeout)
                    except TransportError:
                        continue  # idle: the feeder may be blocked on credits; check again
                    if d is None:
                        break
                    got.take(d)
                    stats.batches += 1
                    rx.release(d)
                feeder.join()
                remote = agent.stats()
        if got.count < len(feeder.names):
            raise AgentError(
                f"agent at {self.address}: {len(feeder.names) - got.count} results lost"
            )
        stats.wall_s = time.perf_counter() - t0
        stats.host_cpu_s = time.process_time() - cpu0
        return got.result(pipeline, plan, feeder, stats, remote)


class _Feeder(threading.Thread):
    """Submits the items (request id = index + 1) while the caller receives; errors carried."""

    def __init__(self, agent: AgentClient, items: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        super().__init__(name="client-feeder", daemon=True)
        self.agent, self.items = agent, items
        self.names: list[str] = []
        self.sent_at: list[float] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for name, values in self.items:
                self.sent_at.append(time.perf_counter())
                self.agent.submit(len(self.names) + 1, values)
                self.names.append(name)
        except BaseException as exc:
            self.error = exc
        self.done.set()

    def finished(self, received: int) -> bool:
        if self.error is not None:
            raise self.error
        return self.done.is_set() and received >= len(self.names)


class _Collector:
    """Per item: the rows of every output (copied out of the slot), or why it failed."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys
        self.rows: dict[int, dict[str, Any]] = {}
        self.failed: dict[int, tuple[str, str]] = {}
        self.done_at: dict[int, float] = {}

    @property
    def count(self) -> int:
        return len(self.rows) + len(self.failed)

    def take(self, d: Delivery) -> None:
        now = time.perf_counter()
        failed = failed_of(d.meta)
        for row, rid in enumerate(d.meta["request_ids"]):
            index = rid - 1
            if index in self.rows or index in self.failed:
                continue  # delivered twice: exactly-once on receipt too
            self.done_at[index] = now
            if rid in failed:
                reason, detail = failed[rid]
                self.failed[index] = (reason, detail)
                continue
            self.rows[index] = {
                name: (
                    d.tensors[key][row] if key in d.tensors else d.tensors[f"{key}@{row}"]
                ).copy()
                for name, key in self.keys.items()
            }

    def result(
        self, pipeline: Pipeline, plan: Plan, feeder: _Feeder, stats: RunStats, remote: dict
    ) -> RunResult:
        n = len(feeder.names)
        specs = pipeline.output_specs()
        outputs: dict[str, Any] = {}
        for name, spec in specs.items():
            if spec.static:
                arr = np.zeros((n, *spec.shape), spec.dtype)
                for i, row in self.rows.items():
                    arr[i] = row[name]
                outputs[name] = arr
            else:
                outputs[name] = [self.rows[i][name] if i in self.rows else None for i in range(n)]
        failures = [ItemFailure(i, feeder.names[i], *self.failed[i]) for i in sorted(self.failed)]
        stats.items, stats.errors = n, len(failures)
        stats.errors_by_reason = dict(Counter(f.reason for f in failures))
        stats.latencies_s = [self.done_at[i] - feeder.sent_at[i] for i in range(n)]
        s = plan.stages[0]
        # as `run --json` reports a stage: its kernels' CPU time per item (the planner's unit),
        # their wall time beside it (the agent's own measurement, `kernels` in its stats)
        # (this run's session's alone, `own`: `kernels` sum every session of the stage name)
        kern = remote.get("own") or remote.get("kernels", {}).get(s.name, {})
        stats.stages[s.name] = {
            "device": s.device,
            "nodes": list(s.nodes),
            "ms_per_item": round(kern.get("cpu_ms_per_item", 0.0), 4),
            "wall_ms_per_item": round(kern.get("wall_ms_per_item", 0.0), 4),
            "steps": {k: round(v["cpu_ms"], 4) for k, v in kern.get("steps", {}).items()},
        }
        ok = np.array([i in self.rows for i in range(n)], bool)
        return RunResult(list(feeder.names), outputs, ok, failures, stats)
