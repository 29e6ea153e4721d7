"""Stage: the nodes of one StagePlan bound to their kernels on one device, fused where possible.

Binding happens once, when the stage is built (kernel choice, fusion, JIT warm-up inside each
kernel's build). Per item, `process` only calls the bound functions in order.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nicoffload import ops
from nicoffload.errors import DeviceError
from nicoffload.graph import Node, Pipeline, TensorSpec
from nicoffload.planner.plan import StagePlan


@dataclass(frozen=True)
class Step:
    """One bound kernel: a single node, or a fused chain of nodes."""

    name: str
    nodes: tuple[Node, ...]
    fn: ops.KernelFn
    reads: tuple[str, ...]  # value keys (Ref text) the first node reads
    writes: tuple[str, ...]  # value keys the last node produces, in op output order
    out_specs: tuple[TensorSpec, ...]


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
        consumers = pipeline.consumers(last.name)
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


class Stage:
    """A StagePlan made runnable: `process(values, dests, timer)` runs one item through it."""

    def __init__(self, pipeline: Pipeline, plan: StagePlan, keep: set[str]) -> None:
        self.plan = plan
        nodes = [pipeline.node(n) for n in plan.nodes]
        self.steps = bind_steps(pipeline, nodes, plan.kind, keep)

    def process(
        self,
        values: dict[str, Any],
        dests: Mapping[str, Any],
        step_ns: list[int],
        step_n: list[int],
    ) -> None:
        """Run every step on one item; outputs with a destination are written straight into it.

        `values` maps value keys to inputs and receives the produced values; `step_ns[i]` and
        `step_n[i]` accumulate the time and the calls of step i. ItemError propagates.
        """
        for i, step in enumerate(self.steps):
            args = [values[k] for k in step.reads]
            targets = [dests.get(k) for k in step.writes]
            direct = all(t is not None for t in targets)
            out = (targets[0] if len(targets) == 1 else tuple(targets)) if direct else None
            t0 = time.perf_counter_ns()
            try:
                result = step.fn(*args, out=out)
            finally:
                step_ns[i] += time.perf_counter_ns() - t0
                step_n[i] += 1
            results = (result,) if len(step.writes) == 1 else result
            for key, value, target in zip(step.writes, results, targets, strict=True):
                if target is not None and not direct:
                    target[...] = value
                values[key] = value
