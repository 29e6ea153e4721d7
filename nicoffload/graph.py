"""The validated pipeline DAG: Pipeline, Node, TensorSpec, built from a PipelineSpec.

Every check that can be made before running is made here, once: op names, parameters, wiring,
cycles, unused nodes, and dtype/shape inference across every edge.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload import ops
from nicoffload.errors import Mark, SpecError
from nicoffload.spec import PipelineSpec, parse_spec
from nicoffload.yamlmarks import did_you_mean


@dataclass(frozen=True)
class Dim:
    """A symbolic dimension (varies per item) with the typical value the planner costs with."""

    name: str
    typical: int

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TensorSpec:
    """dtype and per-item shape of what flows on an edge (the batch dimension is implicit).

    dtype is a numpy dtype name, or "bytes" (encoded data) or "str" (text), both 1-D variable.
    """

    dtype: str
    shape: tuple[int | Dim, ...]
    layout: str = ""
    hints: tuple[tuple[str, Any], ...] = ()

    @property
    def static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape) and self.dtype not in ("bytes", "str")

    @property
    def typical_shape(self) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else d.typical for d in self.shape)

    @property
    def itemsize(self) -> int:
        return 1 if self.dtype in ("bytes", "str") else np.dtype(self.dtype).itemsize

    @property
    def typical_nbytes(self) -> int:
        return math.prod(self.typical_shape) * self.itemsize

    def hint(self, key: str, default: Any = None) -> Any:
        return dict(self.hints).get(key, default)

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]" + (f" {self.layout}" if self.layout else "")


@dataclass(frozen=True)
class Ref:
    """One end of an edge: a pipeline input, or an output port of a node."""

    source: str
    port: str = "out"
    is_input: bool = False

    def __str__(self) -> str:
        return self.source if self.port == "out" or self.is_input else f"{self.source}.{self.port}"


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    params: dict[str, Any]
    inputs: tuple[Ref, ...]
    in_specs: tuple[TensorSpec, ...]
    out_specs: dict[str, TensorSpec]
    mark: Mark

    @property
    def out(self) -> TensorSpec:
        """The output spec of a single-output node."""
        return next(iter(self.out_specs.values()))

    def opdef(self) -> ops.OpDef:
        found = ops.get_op(self.op)
        assert found is not None
        return found

    def work(self) -> float:
        """The op's cost feature (pixels, bytes or tokens) at typical sizes."""
        return float(self.opdef().work(self.params, self.in_specs, self.out_specs))


@dataclass(frozen=True)
class Pipeline:
    name: str
    path: str
    inputs: dict[str, TensorSpec]
    nodes: tuple[Node, ...]  # topological order
    outputs: dict[str, Ref]
    batch_max_size: int
    batch_max_wait_ms: float
    placement: dict[str, tuple[str, ...]] = field(default_factory=dict)
    slo_latency_ms: float | None = None
    slo_throughput_per_s: float | None = None

    @functools.cached_property
    def _by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @functools.cached_property
    def _consumers(self) -> dict[str, tuple[Node, ...]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for src in dict.fromkeys(r.source for r in n.inputs if not r.is_input):
                out.setdefault(src, []).append(n)
        return {k: tuple(v) for k, v in out.items()}

    def node(self, name: str) -> Node:
        return self._by_name[name]

    def spec_of(self, ref: Ref) -> TensorSpec:
        return (
            self.inputs[ref.source] if ref.is_input else self.node(ref.source).out_specs[ref.port]
        )

    def consumers(self, name: str) -> tuple[Node, ...]:
        return self._consumers.get(name, ())

    def output_specs(self) -> dict[str, TensorSpec]:
        return {k: self.spec_of(r) for k, r in self.outputs.items()}


def _input_spec(kind: str, fmt: str | None, typical: dict[str, int]) -> TensorSpec:
    if kind == "text":
        return TensorSpec(
            "str", (Dim("nchars", typical.get("chars", 200)),), hints=(("kind", "text"),)
        )
    hints = [("kind", "bytes"), ("format", fmt or "any")]
    hints += [(k, v) for k, v in sorted(typical.items()) if k != "bytes"]
    nbytes = typical.get("bytes")
    if nbytes is None:  # an image's size without its file's: a photo's bytes at that size
        h, w = typical.get("height"), typical.get("width")
        nbytes = max(1, round(h * w * JPEG_BYTES_PER_PIXEL)) if h and w else DEFAULT_BYTES
    return TensorSpec("bytes", (Dim("nbytes", nbytes),), hints=tuple(hints))


# A typical photo's JPEG at quality 90, 4:2:0: 110 KB at 500x375 (ImageNet's median size). What a
# bytes input without `typical: bytes` is priced at: by its height x width when given, else this.
DEFAULT_BYTES = 110_000
JPEG_BYTES_PER_PIXEL = DEFAULT_BYTES / (500 * 375)


def _resolve(text: str, mark: Mark, spec: PipelineSpec, known: dict[str, ops.OpDef | None]) -> Ref:
    if text in spec.inputs:
        return Ref(text, "in", is_input=True)
    name, _, port = text.partition(".")
    if name not in known:
        choices = list(spec.inputs) + list(known)
        raise SpecError(f"'{text}' names no input or node{did_you_mean(name, choices)}", mark)
    opdef = known[name]
    ports = opdef.outputs if opdef else ("out",)
    if not port:
        if len(ports) > 1:
            raise SpecError(
                f"node '{name}' has several outputs; name one: {', '.join(f'{name}.{p}' for p in ports)}",
                mark,
            )
        port = ports[0]
    elif port not in ports:
        raise SpecError(f"node '{name}' has no output '{port}'{did_you_mean(port, ports)}", mark)
    return Ref(name, port)


def _topo_order(spec: PipelineSpec, refs: dict[str, tuple[Ref, ...]]) -> list[str]:
    pending = {n.name: {r.source for r in refs[n.name] if not r.is_input} for n in spec.nodes}
    order: list[str] = []
    while pending:
        ready = [n for n, deps in pending.items() if not deps]
        if not ready:
            cycle = _find_cycle(pending)
            first = next(n for n in spec.nodes if n.name == cycle[0])
            raise SpecError(
                f"the nodes form a cycle: {' -> '.join([*cycle, cycle[0]])}", first.mark
            )
        for n in sorted(ready, key=lambda x: [s.name for s in spec.nodes].index(x)):
            order.append(n)
            del pending[n]
        for deps in pending.values():
            deps.difference_update(ready)
    return order


def _find_cycle(pending: dict[str, set[str]]) -> list[str]:
    start = next(iter(pending))
    path = [start]
    while True:
        nxt = next(iter(pending[path[-1]]))
        if nxt in path:
            return path[path.index(nxt) :]
        path.append(nxt)


def build_pipeline(spec: PipelineSpec, tokenizer_dir: str | None = None) -> Pipeline:
    """Validate a PipelineSpec into a Pipeline; the first mistake raises SpecError at its mark.
    `tokenizer_dir` (an agent's LOAD; "" for none): file parameters are ids (`_by_id`)."""
    known: dict[str, ops.OpDef | None] = {}
    params: dict[str, dict[str, Any]] = {}
    for n in spec.nodes:
        if n.name in spec.inputs:
            raise SpecError(f"node '{n.name}' has the same name as an input", n.mark)
        if n.name in known:
            first = next(m for m in spec.nodes if m.name == n.name)
            raise SpecError(
                f"duplicate node name '{n.name}' (first at line {first.mark.line})", n.mark
            )
        opdef = ops.get_op(n.op)
        if opdef is None:
            raise SpecError(
                f"node '{n.name}': unknown op '{n.op}'{did_you_mean(n.op, ops.op_names())}",
                n.op_mark,
            )
        known[n.name] = opdef
        try:
            raw = n.params if tokenizer_dir is None else _by_id(opdef, n.params, tokenizer_dir)
            params[n.name] = opdef.bind(raw, spec.directory)
        except ops.ParamError as exc:
            # an unknown name is wrong at its key; any other mistake at the value (whose
            # message may say "unknown" too: a tokenizer file's parser does)
            where = (
                n.param_marks.get(exc.param)
                if str(exc).startswith("unknown parameter")
                else n.value_marks.get(exc.param)
            )
            raise SpecError(f"node '{n.name}': {exc}", where or n.mark) from None
        if len(n.inputs) != opdef.n_inputs:
            raise SpecError(
                f"node '{n.name}': op '{n.op}' takes {opdef.n_inputs} input(s), got {len(n.inputs)}",
                n.in_marks[0] if n.in_marks else n.mark,
            )
    refs = {
        n.name: tuple(
            _resolve(t, m, spec, known) for t, m in zip(n.inputs, n.in_marks, strict=True)
        )
        for n in spec.nodes
    }
    order = _topo_order(spec, refs)

    inputs = {k: _input_spec(v.kind, v.format, v.typical) for k, v in spec.inputs.items()}
    by_name = {n.name: n for n in spec.nodes}
    built: dict[str, Node] = {}
    for name in order:
        ns, opdef = by_name[name], known[name]
        assert opdef is not None
        in_specs = tuple(
            inputs[r.source] if r.is_input else built[r.source].out_specs[r.port]
            for r in refs[name]
        )
        try:
            out_specs = opdef.infer(params[name], in_specs)
        except ops.WiringError as exc:
            raise SpecError(f"node '{name}': {exc}", ns.in_marks[0]) from None
        except ops.ParamError as exc:
            raise SpecError(
                f"node '{name}': {exc}", ns.value_marks.get(exc.param, ns.mark)
            ) from None
        built[name] = Node(name, ns.op, params[name], refs[name], in_specs, out_specs, ns.mark)

    outputs = {out: _resolve(text, mark, spec, known) for out, (text, mark) in spec.outputs.items()}
    _check_all_used(spec, refs, outputs)
    for node, (_devices, mark) in spec.placement.items():
        if node not in built:
            raise SpecError(
                f"placement names no node '{node}'{did_you_mean(node, list(built))}", mark
            )
    return Pipeline(
        name=spec.name,
        path=spec.path,
        inputs=inputs,
        nodes=tuple(built[n] for n in order),
        outputs=outputs,
        batch_max_size=spec.batch_max_size,
        batch_max_wait_ms=spec.batch_max_wait_ms,
        placement={k: v for k, (v, _) in spec.placement.items()},
        slo_latency_ms=spec.slo_latency_ms,
        slo_throughput_per_s=spec.slo_throughput_per_s,
    )


def _by_id(opdef: ops.OpDef, raw: dict[str, Any], directory: str) -> dict[str, Any]:
    """The parameters with every file (the tokenizer is the only one) named by an id and
    resolved to the agent's file of that id, before anything opens a path the client named."""
    from nicoffload.ops.tokenize import tokenizer_by_id

    files = {p.name for p in opdef.params if p.kind == "path"} & set(raw)
    return {k: tokenizer_by_id(k, v, directory) if k in files else v for k, v in raw.items()}


def _check_all_used(
    spec: PipelineSpec, refs: dict[str, tuple[Ref, ...]], outputs: dict[str, Ref]
) -> None:
    live: set[str] = set()
    stack = [r.source for r in outputs.values()]
    while stack:
        name = stack.pop()
        if name in live:
            continue
        live.add(name)
        stack.extend(r.source for r in refs.get(name, ()))
    for n in spec.nodes:
        if n.name not in live:
            raise SpecError(f"node '{n.name}' is unused: no output depends on it", n.mark)
    for name, inp in spec.inputs.items():
        if name not in live:
            raise SpecError(f"input '{name}' is unused: no node reads it", inp.mark)


def load_pipeline(path: str | Path, tokenizer_dir: str | None = None) -> Pipeline:
    """Read, check and build a pipeline file (`tokenizer_dir`: see build_pipeline)."""
    return build_pipeline(parse_spec(path), tokenizer_dir)


def with_typical(pipeline: Pipeline, typical: Mapping[str, Mapping[str, int]]) -> Pipeline:
    """The pipeline with these inputs' typical sizes (`sizes.typical_of`) in place of its own,
    every node's TensorSpecs inferred again from them: what the planner prices."""
    inputs = dict(pipeline.inputs)
    for name, t in typical.items():
        old = inputs[name]
        hints = dict(old.hints)
        kind = "text" if old.dtype == "str" else "bytes"
        fmt = hints.get("format")
        inputs[name] = _input_spec(kind, None if fmt in (None, "any") else str(fmt), dict(t))
    built: dict[str, Node] = {}
    for node in pipeline.nodes:
        in_specs = tuple(
            inputs[r.source] if r.is_input else built[r.source].out_specs[r.port]
            for r in node.inputs
        )
        out_specs = node.opdef().infer(node.params, in_specs)
        built[node.name] = dataclasses.replace(node, in_specs=in_specs, out_specs=out_specs)
    return dataclasses.replace(
        pipeline, inputs=inputs, nodes=tuple(built[n.name] for n in pipeline.nodes)
    )
