"""Pipeline YAML -> PipelineSpec: the file's structure checked, every piece keeping its mark.

Operator names, parameters and the wiring are checked later against the op registry by
`graph.build_pipeline`; this module only knows the file's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, SpecError
from nicoffload.yamlmarks import MMap, MSeq, did_you_mean, read_marked

TOP_KEYS = ("name", "inputs", "nodes", "outputs", "batch", "placement", "slo", "description")
NODE_KEYS = ("name", "op", "in", "params")
INPUT_KINDS = ("bytes", "text")
INPUT_KEYS = ("kind", "format", "typical")
BATCH_KEYS = ("max_size", "max_wait_ms")
SLO_KEYS = ("latency_ms", "throughput_per_s")
DEVICE_KINDS = ("cpu", "dpu", "gpu")


@dataclass(frozen=True)
class InputSpec:
    name: str
    kind: str  # "bytes" | "text"
    format: str | None
    typical: dict[str, float]  # sizes (int), `progressive` a share
    mark: Mark


@dataclass(frozen=True)
class NodeSpec:
    name: str
    op: str
    inputs: tuple[str, ...]
    params: dict[str, Any]
    mark: Mark
    op_mark: Mark
    in_marks: tuple[Mark, ...]
    param_marks: dict[str, Mark]  # the key's mark (where a wrong name is)
    value_marks: dict[str, Mark]  # the value's mark (where a wrong value is)


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    path: str
    inputs: dict[str, InputSpec]
    nodes: tuple[NodeSpec, ...]
    outputs: dict[str, tuple[str, Mark]]
    batch_max_size: int = 64
    batch_max_wait_ms: float = 2.0
    placement: dict[str, tuple[tuple[str, ...], Mark]] = field(default_factory=dict)
    slo_latency_ms: float | None = None
    slo_throughput_per_s: float | None = None
    mark: Mark = field(default_factory=lambda: Mark("<memory>", 1, 1))

    @property
    def directory(self) -> Path:
        return Path(self.path).parent


def _expect(value: Any, kind: type | tuple[type, ...], what: str, mark: Mark) -> Any:
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        names = {MMap: "a mapping", MSeq: "a list", str: "a string", int: "an integer"}
        want = names.get(kind, "a number") if isinstance(kind, type) else "a number"
        raise SpecError(f"{what} must be {want}, got {_show(value)}", mark)
    return value


def _show(value: Any) -> str:
    if isinstance(value, MMap):
        return "a mapping"
    if isinstance(value, MSeq):
        return "a list"
    return repr(value)


def _check_keys(m: MMap, allowed: tuple[str, ...], where: str) -> None:
    for key in m:
        if key not in allowed:
            raise SpecError(
                f"{where}: unknown key '{key}'{did_you_mean(key, allowed)}", m.key_marks[key]
            )


def _share(m: MMap, key: str, where: str) -> float:
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise SpecError(
            f"{where}.{key} must be a share from 0 to 1, got {_show(value)}", m.value_marks[key]
        )
    return float(value)


def _positive(m: MMap, key: str, kind: type, where: str) -> Any:
    value = m[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and isinstance(value, int)
    if not ok or value <= 0:
        want = "a positive integer" if kind is int else "a positive number"
        raise SpecError(f"{where}.{key} must be {want}, got {_show(value)}", m.value_marks[key])
    return value


def _parse_inputs(doc: MMap) -> dict[str, InputSpec]:
    raw = _expect(doc["inputs"], MMap, "'inputs'", doc.mark_of("inputs"))
    if not raw:
        raise SpecError("'inputs' must declare at least one input", raw.mark)
    out = {}
    for name, body in raw.items():
        mark = raw.key_marks[name]
        _expect(name, str, "an input name", mark)
        body = _expect(body, MMap, f"input '{name}'", raw.value_marks[name])
        _check_keys(body, INPUT_KEYS, f"input '{name}'")
        if "kind" not in body:
            raise SpecError(f"input '{name}': missing 'kind' (one of: bytes, text)", body.mark)
        kind = body["kind"]
        if kind not in INPUT_KINDS:
            raise SpecError(
                f"input '{name}': unknown kind {_show(kind)}{did_you_mean(str(kind), INPUT_KINDS)}",
                body.value_marks["kind"],
            )
        typical = body.get("typical", MMap())
        if "typical" in body:
            typical = _expect(typical, MMap, f"input '{name}'.typical", body.value_marks["typical"])
            for key in typical:
                # the shares of the items that are progressive JPEGs, and that a GPU decoder
                # leaves to the host (progressive, gray, CMYK, arithmetic-coded)
                if key in ("progressive", "host_decoded"):
                    if kind != "bytes" or body.get("format") != "jpeg":
                        raise SpecError(
                            f"input '{name}'.typical.{key} is for JPEG inputs "
                            "(kind: bytes, format: jpeg)",
                            typical.key_marks[key],
                        )
                    _share(typical, key, f"input '{name}'.typical")
                else:
                    _positive(typical, key, int, f"input '{name}'.typical")
        fmt = body.get("format")
        out[name] = InputSpec(name, kind, None if fmt is None else str(fmt), dict(typical), mark)
    return out


def _parse_node(raw: Any, mark: Mark) -> NodeSpec:
    body = _expect(raw, MMap, "a node", mark)
    _check_keys(body, NODE_KEYS, "node")
    for key in ("name", "op", "in"):
        if key not in body:
            label = f"node '{body['name']}'" if isinstance(body.get("name"), str) else "node"
            raise SpecError(f"{label}: missing '{key}'", body.mark)
    name = _expect(body["name"], str, "a node name", body.value_marks["name"])
    where = f"node '{name}'"
    op = _expect(body["op"], str, f"{where}: 'op'", body.value_marks["op"])
    ins = body["in"]
    if isinstance(ins, str):
        inputs, in_marks = (ins,), (body.value_marks["in"],)
    else:
        ins = _expect(ins, MSeq, f"{where}: 'in'", body.value_marks["in"])
        for item, m in zip(ins, ins.item_marks, strict=True):
            _expect(item, str, f"{where}: each entry of 'in'", m)
        inputs, in_marks = tuple(ins), tuple(ins.item_marks)
    params = body.get("params", MMap())
    if "params" in body:
        params = _expect(params, MMap, f"{where}: 'params'", body.value_marks["params"])
    if not hasattr(params, "key_marks"):
        params.mark, params.key_marks, params.value_marks = body.mark, {}, {}
    return NodeSpec(
        name=name,
        op=op,
        inputs=inputs,
        params=dict(params),
        mark=body.key_marks["name"],
        op_mark=body.value_marks["op"],
        in_marks=in_marks,
        param_marks=dict(params.key_marks),
        value_marks=dict(params.value_marks),
    )


def _parse_placement(doc: MMap) -> dict[str, tuple[tuple[str, ...], Mark]]:
    raw = _expect(doc["placement"], MMap, "'placement'", doc.mark_of("placement"))
    out = {}
    for node, devices in raw.items():
        vmark = raw.value_marks[node]
        if isinstance(devices, str):
            devices = MSeq([devices])
            devices.mark, devices.item_marks = vmark, [vmark]
        devices = _expect(devices, MSeq, f"placement of '{node}'", vmark)
        if not devices:
            raise SpecError(f"placement of '{node}' allows no device", vmark)
        for dev, m in zip(devices, devices.item_marks, strict=True):
            kind = str(dev).split(":", 1)[0]
            if kind not in DEVICE_KINDS:
                raise SpecError(
                    f"placement of '{node}': unknown device {dev!r}{did_you_mean(kind, DEVICE_KINDS)}",
                    m,
                )
        out[str(node)] = (tuple(str(d) for d in devices), raw.key_marks[node])
    return out


def parse_spec(path: str | Path) -> PipelineSpec:
    """Read a pipeline file; raise SpecError at the mark of the first structural mistake."""
    doc = read_marked(path, SpecError)
    if not isinstance(doc, MMap):
        raise SpecError(
            "a pipeline file must be a mapping (name, inputs, nodes, outputs)",
            doc.mark if hasattr(doc, "mark") else Mark(str(path), 1, 1),
        )
    _check_keys(doc, TOP_KEYS, "pipeline")
    for key in ("inputs", "nodes", "outputs"):
        if key not in doc:
            raise SpecError(f"pipeline: missing '{key}'", doc.mark)
    name = _expect(doc.get("name", Path(path).stem), str, "'name'", doc.mark_of("name"))
    nodes_raw = _expect(doc["nodes"], MSeq, "'nodes'", doc.mark_of("nodes"))
    if not nodes_raw:
        raise SpecError("'nodes' must list at least one node", nodes_raw.mark)
    nodes = tuple(_parse_node(n, m) for n, m in zip(nodes_raw, nodes_raw.item_marks, strict=True))
    outs_raw = _expect(doc["outputs"], MMap, "'outputs'", doc.mark_of("outputs"))
    if not outs_raw:
        raise SpecError("'outputs' must name at least one output", outs_raw.mark)
    outputs = {}
    for out_name, ref in outs_raw.items():
        _expect(ref, str, f"output '{out_name}'", outs_raw.value_marks[out_name])
        outputs[str(out_name)] = (ref, outs_raw.value_marks[out_name])
    extra: dict[str, Any] = {}
    if "batch" in doc:
        batch = _expect(doc["batch"], MMap, "'batch'", doc.mark_of("batch"))
        _check_keys(batch, BATCH_KEYS, "batch")
        if "max_size" in batch:
            extra["batch_max_size"] = _positive(batch, "max_size", int, "batch")
        if "max_wait_ms" in batch:
            extra["batch_max_wait_ms"] = float(_positive(batch, "max_wait_ms", float, "batch"))
    if "slo" in doc:
        slo = _expect(doc["slo"], MMap, "'slo'", doc.mark_of("slo"))
        _check_keys(slo, SLO_KEYS, "slo")
        for key in SLO_KEYS:
            if key in slo:
                extra[f"slo_{key}"] = float(_positive(slo, key, float, "slo"))
    if "placement" in doc:
        extra["placement"] = _parse_placement(doc)
    return PipelineSpec(
        name=name,
        path=str(path),
        inputs=_parse_inputs(doc),
        nodes=nodes,
        outputs=outputs,
        mark=doc.mark,
        **extra,
    )
