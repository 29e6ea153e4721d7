"""Stage: the nodes of one StagePlan bound to their kernels on one device, fused where possible.

Binding happens once, when the stage is built (kernel choice, fusion, JIT warm-up inside each
kernel's build). Per item, `process` only calls the bound functions in order.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nicoffload import ops
from nicoffload.errors import DeviceError
from nicoffload.graph import Node, Pipeline, TensorSpec
from nicoffload.planner.plan import Plan, StagePlan


@dataclass(frozen=True)
class Step:
    """One bound kernel: a single node, or a fused chain of nodes."""

    name: str
    nodes: tuple[Node, ...]
    fn: ops.KernelFn
    reads: tuple[str, ...]  # value keys (Ref text) the first node reads
    writes: tuple[str, ...]  # value keys the last node produces, in op output order
    out_specs: tuple[TensorSpec, ...]

    @property
    def allocates(self) -> bool:
        """Whether `fn` takes an allocator as `out` (`ops.Alloc`) for an output of varying
        shape, and writes into what it gives."""
        return getattr(self.fn, "allocates", False)


def _into(dest: Any, value: Any) -> Any:
    dest[...] = value
    return dest


def _key(node: Node, port: str) -> str:
    return node.name if port == "out" else f"{node.name}.{port}"


def _fusable(pipeline: Pipeline, chain: list[Node], keep: set[str]) -> bool:
    """Inner nodes of a fused chain must feed only the next node and leave nothing behind."""
    for a, b in itertools.pairwise(chain):
        if len(a.out_specs) != 1 or _key(a, "out") in keep:
            return False
        consumers = pipeline.consumers(a.name)
        if len(consumers) != 1 or consumers[0].name != b.name or len(b.inputs) != 1:
            return False
    return True


def bind_steps(
    pipeline: Pipeline, nodes: list[Node], device_kind: str, keep: set[str]
) -> list[Step]:
    """Cover `nodes` (topological order) with kernels, greedily taking the longest fused chain.

    `keep` holds the value keys that must exist after the stage (outputs, cross-stage edges).
    """
    fused = ops.fused_kernels(device_kind)
    steps: list[Step] = []
    i = 0
    while i < len(nodes):
        chosen: ops.Kernel | None = None
        for k in fused:
            chain = nodes[i : i + len(k.ops)]
            if tuple(n.op for n in chain) == k.ops and _fusable(pipeline, chain, keep):
                chosen = k
                break
        if chosen is None:
            try:
                chosen = ops.get_kernel(nodes[i].op, device_kind)
            except KeyError as exc:
                raise DeviceError(f"node '{nodes[i].name}': {exc.args[0]}") from None
        chain = nodes[i : i + len(chosen.ops)]
        last = chain[-1]
        # with PIPELINE_OUTPUT when the chain's output is a pipeline output: a decoder whose
        # image is returned decodes it at full size, not DCT-scaled for the resize after it
        consumers = ops.kernel_consumers(pipeline, last.name)
        steps.append(
            Step(
                name="+".join(n.name for n in chain),
                nodes=tuple(chain),
                fn=chosen.build(chain, consumers),
                reads=tuple(str(r) for r in chain[0].inputs),
                writes=tuple(_key(last, p) for p in last.out_specs),
                out_specs=tuple(last.out_specs.values()),
            )
        )
        i += len(chain)
    return steps


@dataclass(frozen=True)
class StepTime:
    """A step's measured cost per item: `cpu_ms` is the CPU time of the calling worker thread
    inside the kernel (core-ms: what a profile's `a + b * work` predicts); `wall_ms` is the same
    calls by the wall clock, which also counts the time the worker was descheduled or waited for
    the GIL. Queue waits before and after the call are in neither."""

    cpu_ms: float
    wall_ms: float
    calls: int


class StepTally:
    """Step costs being counted by one caller (a worker's rows of a batch) before they are
    added to the stage's `times()` at once (`Stage.add`): one lock for many items."""

    __slots__ = ("calls", "cpu_ns", "wall_ns")

    def __init__(self, n: int) -> None:
        self.cpu_ns, self.wall_ns, self.calls = [0] * n, [0] * n, [0] * n


class Stage:
    """A StagePlan made runnable: `process(values, dests)` runs one item through it, and
    `times()` says what its steps have cost per item in the current call (summed over every
    worker; `begin_call` starts a call)."""

    def __init__(self, pipeline: Pipeline, plan: StagePlan, keep: set[str]) -> None:
        self.plan = plan
        nodes = [pipeline.node(n) for n in plan.nodes]
        self.steps = bind_steps(pipeline, nodes, plan.kind, keep)
        self._lock = threading.Lock()
        self._total = StepTally(len(self.steps))
        self._mark = StepTally(len(self.steps))  # the totals when the current call began

    def begin_call(self) -> None:
        """A session's new call: `times()` counts from here (a call's own figures, not the
        mean of every call the session has made)."""
        t, m = self._total, self._mark
        with self._lock:
            m.cpu_ns, m.wall_ns, m.calls = list(t.cpu_ns), list(t.wall_ns), list(t.calls)

    def times(self) -> dict[str, StepTime]:
        """Per step, the mean cost of the calls made since `begin_call` (or since the stage was
        made; zeros before the first)."""
        t, m = self._total, self._mark
        with self._lock:
            rows = zip(
                self.steps, t.cpu_ns, t.wall_ns, t.calls, m.cpu_ns, m.wall_ns, m.calls, strict=True
            )
            return {
                st.name: _mean(cpu - cpu0, wall - wall0, n - n0)
                for st, cpu, wall, n, cpu0, wall0, n0 in rows
            }

    def tally(self) -> StepTally:
        """A fresh count for `process(..., tally=)`, added to `times()` by `add`."""
        return StepTally(len(self.steps))

    def add(self, tally: StepTally) -> None:
        t = self._total
        with self._lock:
            for i in range(len(self.steps)):
                t.cpu_ns[i] += tally.cpu_ns[i]
                t.wall_ns[i] += tally.wall_ns[i]
                t.calls[i] += tally.calls[i]

    def process(
        self, values: dict[str, Any], dests: Mapping[str, Any], tally: StepTally | None = None
    ) -> list[str]:
        """Run every step on one item; outputs with a destination are written straight into it.
        Returns the keys of `dests` it wrote (the caller stamps those rows as written).

        A destination is an array (a static output's row), or an allocator (`ops.Alloc`: an
        output of varying shape, called once with its shape and dtype): a kernel whose `fn`
        says it `allocates` writes into what it returns; another's result is copied there.

        `values` maps value keys to inputs and receives the produced values. Each call's time
        is added to `times()`: at once, or to `tally` when one is given (the caller then `add`s
        it, once for many items). ItemError propagates.
        """
        own = tally is None
        t = self.tally() if own else tally
        cpu, wall, calls = t.cpu_ns, t.wall_ns, t.calls
        clock, thread_clock = time.perf_counter_ns, time.thread_time_ns
        written: list[str] = []
        try:
            for i, step in enumerate(self.steps):
                args = [values[k] for k in step.reads]
                targets: tuple[Any, ...] = tuple(dests.get(k) for k in step.writes)
                arrays = tuple(hasattr(d, "shape") for d in targets)  # else an allocator
                if len(targets) == 1:
                    out = targets[0]
                    if out is not None and not arrays[0] and not step.allocates:
                        out = None  # an allocator, to a kernel that does not take one
                else:
                    out = targets if all(arrays) else None
                t0, c0 = clock(), thread_clock()
                try:
                    result = step.fn(*args, out=out)
                finally:
                    cpu[i] += thread_clock() - c0
                    wall[i] += clock() - t0
                    calls[i] += 1
                results = (result,) if len(step.writes) == 1 else result
                for key, value, target, array in zip(
                    step.writes, results, targets, arrays, strict=True
                ):
                    if target is not None:
                        if target is out and not array:
                            pass  # the kernel wrote into what it took from the allocator
                        elif not array:  # copied into an allocated one
                            value = _into(target(value.shape, value.dtype), value)
                        elif value is not target:  # not direct, or a kernel that ignored `out`
                            target[...] = value
                        written.append(key)
                    values[key] = value
        finally:
            if own:
                self.add(t)
        return written


def _mean(cpu_ns: int, wall_ns: int, n: int) -> StepTime:
    return StepTime(cpu_ns / 1e6 / n, wall_ns / 1e6 / n, n) if n else StepTime(0.0, 0.0, 0)


def split_stages(plan: Plan) -> tuple[StagePlan | None, list[StagePlan], StagePlan | None]:
    """A plan as [a leading DPU stage], host CPU stages, [a trailing GPU stage]: the shapes the
    executor's fast path runs; DeviceError for any other (`runtime.chain` runs those)."""
    stages = list(plan.stages)
    lead = stages.pop(0) if stages[0].kind == "dpu" else None
    tail = stages.pop() if stages and stages[-1].kind == "gpu" else None
    for s in stages:
        if s.kind != "cpu":
            raise DeviceError(
                f"stage '{s.name}' is placed on '{s.device}': the fast path runs a leading DPU "
                "stage (through its agent), host CPU stages and a trailing GPU stage; "
                "runtime.chain runs this plan (chain.executor_for)"
            )
    return lead, stages, tail
