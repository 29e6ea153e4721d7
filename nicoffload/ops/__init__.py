"""The operator registry: what each op means (OpDef) and its kernels, keyed by (op, device).

Ops and kernels register themselves with decorators when their module is imported; registering
twice is an error, and asking for a missing kernel lists what exists (torchvision's habit).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nicoffload.graph import Node, TensorSpec

DEVICES = ("cpu", "dpu", "gpu")
REQUIRED = object()
OP_MODULES = (
    "decode",
    "resize",
    "crop",
    "normalize",
    "fused",
    "tokenize",
    "gpu_image",
    "gpu_decode",
)


DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def resolve_data_path(param: str, value: str, base_dir: Path | None) -> str:
    """A shipped data file by name (`bert-base-uncased`), else a path next to the pipeline file."""
    shipped = DATA_DIR / f"{value}.json"
    if "/" not in value and shipped.is_file():
        return str(shipped)
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        names = sorted(p.stem for p in DATA_DIR.glob("*.json"))
        raise ParamError(
            param,
            f"parameter '{param}': no file '{path}' (shipped names: {', '.join(names) or 'none'})",
        )
    return str(path.resolve())


class ParamError(ValueError):
    """A parameter value is wrong; graph building turns it into a SpecError at its mark."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


class WiringError(ValueError):
    """An op's inputs have the wrong type; graph building points at the node's 'in'."""


@dataclass(frozen=True)
class Param:
    """One parameter of an op: its type, default and what values it accepts."""

    name: str
    kind: str  # int | float | bool | str | size | floats | path
    default: Any = REQUIRED
    choices: tuple[Any, ...] | None = None
    doc: str = ""
    minimum: float | None = None

    def json_schema(self) -> dict[str, Any]:
        base: dict[str, Any] = {
            "int": {"type": "integer"},
            "float": {"type": "number"},
            "bool": {"type": "boolean"},
            "str": {"type": "string"},
            "path": {"type": "string"},
            "floats": {"type": "array", "items": {"type": "number"}, "minItems": 1},
            "size": {
                "oneOf": [
                    {"type": "integer", "minimum": 1},
                    {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 1},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                ]
            },
        }[self.kind]
        if self.choices:
            base = {"enum": list(self.choices)}
        if self.minimum is not None:
            base["minimum"] = self.minimum
        if self.doc:
            base["description"] = self.doc
        if self.default is not REQUIRED and self.default is not None:
            base["default"] = (
                list(self.default) if isinstance(self.default, tuple) else self.default
            )
        return base

    def coerce(self, value: Any, base_dir: Path | None = None) -> Any:
        """The checked, normalized value; ParamError says what would be right.

        A `path` is a name of a file shipped in `nicoffload/data/`, or a path relative to the
        pipeline file's folder (`base_dir`); it must exist.
        """
        if value is None and self.default is None:
            return None
        want = {
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "str": "a string",
            "path": "a file path",
            "floats": "a list of numbers",
            "size": "an integer or [height, width]",
        }[self.kind]
        bad = ParamError(self.name, f"parameter '{self.name}' must be {want}, got {value!r}")
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad
        elif self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad
            value = float(value)
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise bad
        elif self.kind in ("str", "path"):
            if not isinstance(value, str):
                raise bad
            if self.kind == "path":
                value = resolve_data_path(self.name, value, base_dir)
        elif self.kind == "floats":
            if not isinstance(value, list) or not value:
                raise bad
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
                raise bad
            value = tuple(float(v) for v in value)
        elif self.kind == "size":
            if isinstance(value, int) and not isinstance(value, bool):
                value = (value, value)
            elif (
                isinstance(value, list)
                and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            ):
                value = tuple(value)
            else:
                raise bad
            if min(value) < 1:
                raise ParamError(
                    self.name, f"parameter '{self.name}' must be positive, got {list(value)}"
                )
        if self.choices is not None and value not in self.choices:
            from nicoffload.yamlmarks import did_you_mean

            raise ParamError(
                self.name,
                f"parameter '{self.name}' is {value!r}{did_you_mean(str(value), [str(c) for c in self.choices])}",
            )
        if self.minimum is not None and value < self.minimum:
            raise ParamError(
                self.name, f"parameter '{self.name}' must be >= {self.minimum}, got {value!r}"
            )
        return value


Infer = Callable[[Mapping[str, Any], Sequence["TensorSpec"]], dict[str, "TensorSpec"]]
Work = Callable[[Mapping[str, Any], Sequence["TensorSpec"], Mapping[str, "TensorSpec"]], float]


@dataclass(frozen=True)
class OpDef:
    """An operator's meaning: parameters, input arity, output inference, and its cost feature."""

    name: str
    params: tuple[Param, ...]
    n_inputs: int
    outputs: tuple[str, ...]
    infer: Infer
    work: Work
    work_unit: str  # pixels | bytes | tokens
    doc: str = ""
    check: Callable[[dict[str, Any]], None] | None = None  # cross-parameter rules
    # a second cost feature, for kernels whose time grows with the encoded bytes they read as
    # well as with `work` (a JPEG's entropy decoding): bytes per item, priced by `c_ms`
    encoded: Work | None = None

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def bind(self, raw: Mapping[str, Any], base_dir: Path | None = None) -> dict[str, Any]:
        """Validate raw parameters into a complete dict (defaults filled); ParamError on mistakes."""
        from nicoffload.yamlmarks import did_you_mean

        names = [p.name for p in self.params]
        for key in raw:
            if key not in names:
                raise ParamError(
                    str(key), f"unknown parameter '{key}'{did_you_mean(str(key), names)}"
                )
        out = {}
        for p in self.params:
            if p.name in raw:
                out[p.name] = p.coerce(raw[p.name], base_dir)
            elif p.default is REQUIRED:
                raise ParamError(p.name, f"missing required parameter '{p.name}'")
            else:
                out[p.name] = p.coerce(p.default, base_dir) if p.kind == "path" else p.default
        if self.check:
            self.check(out)
        return out


KernelFn = Callable[..., Any]
# What the runtime may pass as `out` for an output of varying shape, to a kernel whose `fn` has
# `allocates = True`: called once with the output's shape and dtype, it gives the array the
# kernel writes into and returns (a decoded image straight into the agent's batch buffer).
Alloc = Callable[[tuple[int, ...], Any], Any]


@dataclass(frozen=True)
class PipelineOutput:
    """Stands among a kernel's `consumers` for a pipeline output that its chain's result also
    is: that reader takes the value as the op's TensorSpec says (a decoder then decodes at
    full size, not DCT-scaled for the resizes that read it too). `PIPELINE_OUTPUT` is the one."""

    op: str = "pipeline output"
    name: str = "<pipeline output>"


PIPELINE_OUTPUT = PipelineOutput()


def kernel_consumers(pipeline: Any, name: str) -> tuple[Any, ...]:
    """What a kernel whose chain ends at node `name` is built with as `consumers`: the nodes
    that read its output, and PIPELINE_OUTPUT when that output is a pipeline output too."""
    outputs = {r.source for r in pipeline.outputs.values() if not r.is_input}
    return (*pipeline.consumers(name), *((PIPELINE_OUTPUT,) if name in outputs else ()))


@dataclass(frozen=True)
class Kernel:
    """One implementation of a chain of ops (usually one) on one device.

    `build(nodes, consumers)` runs once at plan time (choices, tables, JIT warm-up) and returns
    `fn(*inputs, out=None)` for one item. `nodes` is the chain this kernel covers; `consumers`
    are the nodes that read the chain's output, with PIPELINE_OUTPUT when it is a pipeline
    output too (`kernel_consumers`; a decoder looks at them to decode smaller).
    `fn` returns one array, or a tuple in the op's output order for several outputs. When the
    runtime passes `out` (same structure; static shapes only), `fn` writes into it and returns
    it; an `fn` with `allocates = True` may also be passed an `Alloc` for an output of varying
    shape, and then returns the array it got from it. A returned array the kernel allocated itself may be a per-thread scratch buffer, valid
    until the same `fn` is next called on the same thread. Per-item failures raise ItemError.
    A `batched` kernel's `fn` takes a whole batch instead (`fn(*batch_inputs, failed=...)`,
    per-item failures recorded by row), which is how GPU kernels run.
    """

    ops: tuple[str, ...]
    device: str
    build: Callable[[Sequence[Node], Sequence[Node]], KernelFn]
    doc: str = ""
    releases_gil: bool = True
    batched: bool = False


@dataclass
class _Registry:
    ops: dict[str, OpDef] = field(default_factory=dict)
    kernels: dict[tuple[tuple[str, ...], str], Kernel] = field(default_factory=dict)
    loaded: bool = False
    done: bool = False  # every op module imported


_REG = _Registry()


def op(
    name: str,
    *,
    params: Sequence[Param] = (),
    n_inputs: int = 1,
    outputs: Sequence[str] = ("out",),
    work: Work,
    work_unit: str,
    check: Callable[[dict[str, Any]], None] | None = None,
    encoded: Work | None = None,
) -> Callable[[Infer], Infer]:
    """Register an op; the decorated function is its output inference."""

    def deco(infer: Infer) -> Infer:
        if name in _REG.ops:
            raise RuntimeError(f"op '{name}' is registered twice")
        _REG.ops[name] = OpDef(
            name,
            tuple(params),
            n_inputs,
            tuple(outputs),
            infer,
            work,
            work_unit,
            (infer.__doc__ or "").strip(),
            check,
            encoded,
        )
        return infer

    return deco


def kernel(
    ops: str | Sequence[str], device: str, *, releases_gil: bool = True, batched: bool = False
):
    """Register a kernel builder for an op (or a fused chain of ops) on a device."""
    chain = (ops,) if isinstance(ops, str) else tuple(ops)
    if device not in DEVICES:
        raise RuntimeError(f"unknown device '{device}' for kernel {chain}")

    def deco(build):
        key = (chain, device)
        if key in _REG.kernels:
            raise RuntimeError(f"kernel {'+'.join(chain)} on '{device}' is registered twice")
        _REG.kernels[key] = Kernel(
            chain, device, build, (build.__doc__ or "").strip(), releases_gil, batched
        )
        return build

    return deco


_LOADING = threading.RLock()  # re-entrant: the op modules' imports reach _load again


def _load() -> None:
    """Import every op module once. Another thread waits until they are all in (a second
    LOAD arriving while the first imported them saw half the ops: "unknown op 'normalize'")."""
    if _REG.done:
        return
    with _LOADING:
        if not _REG.loaded:
            _REG.loaded = True  # what this thread's own nested calls see
            for mod in OP_MODULES:
                importlib.import_module(f"nicoffload.ops.{mod}")
            _REG.done = True


def get_op(name: str) -> OpDef | None:
    _load()
    return _REG.ops.get(name)


def op_names() -> list[str]:
    _load()
    return sorted(_REG.ops)


def kernels_for(op_name: str) -> dict[str, Kernel]:
    """The single-op kernels of an op, by device: the planner's search space for a node."""
    _load()
    return {dev: k for (chain, dev), k in _REG.kernels.items() if chain == (op_name,)}


def get_kernel(ops: str | Sequence[str], device: str) -> Kernel:
    _load()
    chain = (ops,) if isinstance(ops, str) else tuple(ops)
    found = _REG.kernels.get((chain, device))
    if found is None:
        have = sorted(f"{'+'.join(c)}@{d}" for c, d in _REG.kernels if c == chain) or ["none"]
        raise KeyError(
            f"no kernel for {'+'.join(chain)} on '{device}'; registered: {', '.join(have)}"
        )
    return found


def fused_kernels(device: str) -> list[Kernel]:
    """Kernels covering chains of two or more ops on a device, longest first."""
    _load()
    fused = [k for (chain, dev), k in _REG.kernels.items() if dev == device and len(chain) > 1]
    return sorted(fused, key=lambda k: -len(k.ops))


def all_kernels() -> list[Kernel]:
    _load()
    return list(_REG.kernels.values())
