"""Cost profiles: what each kernel costs on a device (`a + b * work` ms per item) and what each
link transport costs, as JSON with the machine, date and method written in.

`nicoffload profile` measures them (see `measure`); devices that cannot be measured here (a
BlueField's Arm cores) ship as documented estimates in `nicoffload/data/profiles/`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, ProfileError

FORMAT = "nicoffload-profile"
# 2: a measured CPU/DPU decode_image is fit at the work of the decode the kernel runs (see
# STALE_DECODE). A version 1 profile is still read where that does not matter: estimates and
# GPU profiles. 3: a decoder's points may carry a third number (the file's bytes, for
# `c_ms_per_byte`), and `runtime` may carry `agent_us_per_item`; versions 1 and 2 are still read.
# 4: `runtime` may carry `serial_us_per_item` and `serial_us_per_batch` (the host process's
# GIL-held time per stage, on the runtime's fast path) and `serial_general_us_per_item`,
# `serial_general_us_per_batch` (on its general path), and `agent_us_per_batch` (the agent's
# own CPU per batch); versions 1 to 3 are still read, without.
# A decoder's entry may carry `progressive_x` (any version): progressive JPEGs' time over
# baseline ones'; without it, progressive items are priced as baseline ones.
VERSION = 4
STALE_DECODE = (
    "its decode_image points record each decode's work as a 6/8 DCT-scaled image (the planner's "
    "rule of its day) while the kernel decoded it at full size, so the planner, which prices "
    "the pixels really decoded, would price decode about 16/9 too high with it"
)
SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "profiles"
# The shipped estimate used for a device kind when this machine has no measured profile.
SHIPPED_DEFAULT = {"cpu": "x86-server", "dpu": "bluefield3-arm", "gpu": "h100"}


@dataclass(frozen=True)
class KernelCost:
    """ms per item of one kernel (one op, or a fused chain `a+b+c`) on one core:
    a + b * work, + c * encoded bytes for a kernel whose op has that second feature
    (`ops.OpDef.encoded`: a JPEG decoder's time grows with the file's bytes as well)."""

    a_ms: float
    b_ms: float
    unit: str  # pixels | bytes | tokens
    # (work, measured ms) the fit came from; (work, measured ms, encoded bytes) with c_ms
    points: tuple[tuple[float, ...], ...] = ()
    c_ms: float = 0.0  # per encoded byte
    # a progressive JPEG's decode time over a baseline one's of the same image (a decoder's
    # entry; libjpeg-turbo about 2.9x on the 2-core VM); None where not measured: priced as 1
    progressive_x: float | None = None

    def ms(self, work: float, encoded: float = 0.0, progressive: float = 0.0) -> float:
        """ms per item; `progressive`: the share of the items that are progressive JPEGs."""
        base = self.a_ms + self.b_ms * work + self.c_ms * encoded
        x = 1.0 if self.progressive_x is None else self.progressive_x
        return base * (1.0 + progressive * (x - 1.0))


# The frame MAC the links' CPU figures were measured under (`transport.integrity`: GMAC since
# 2026-12-02; HMAC-SHA256 before, about 3x the CPU per byte).
FRAME_MAC = "gmac"


@dataclass(frozen=True)
class LinkCost:
    """A transport as measured on a machine; topology files may override any of it."""

    latency_ms: float
    bandwidth: float  # bytes per second, each direction
    cpu_ns_per_byte: float  # CPU time at each CPU endpoint
    # and per batch (frames, credits, the MAC's fixed part); None in a profile measured before
    # links were measured through nicoffload's own transports (its CPU figures are raw sockets')
    cpu_us_per_batch: float | None = 0.0
    # the bandwidth measured from another process, as an agent's outputs reach the host
    # (`profiling_links.stream_bandwidth`); False: between two threads of one process, before it was
    across: bool = False


@dataclass(frozen=True)
class Profile:
    kind: str  # the device kind the kernels were run as: cpu | dpu | gpu
    kernels: dict[str, KernelCost]
    links: dict[str, LinkCost] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    date: str = ""
    method: str = ""  # "measured: ..." or "estimate: ..."
    basis: str = ""  # for estimates: what the numbers are derived from
    source: str = "<memory>"
    # the host runtime's own CPU per item outside the kernels (batching, queues, row status,
    # handing batches out), measured through a real Session (`profiling.measure_runtime`)
    runtime_us_per_item: float | None = None
    # the DPU agent's own CPU per item outside its kernels and its transfers (parsing requests,
    # batching, row status, forwarding), measured through a real agent on these cores
    # (`profiling.measure_agent_runtime`); the planner prices it as CPU on the DPU's cores
    # (planner.cost._agent_ends; not as one process's serial work: it is tens of us per item)
    agent_us_per_item: float | None = None
    # the host process's serial time per item of a host stage, its interpreter (the GIL) held:
    # a + b / batch size, measured through the real runtime over tiny JPEGs
    # (`profiling_serial.measure_host_serial`); the planner caps a plan's throughput at one over its
    # host stages' sum (planner.cost.host_serial). None: measured before it was. On the
    # runtime's fast path (`runtime.executor`), then on its general path (`runtime.chain`)
    serial_us_per_item: float | None = None
    serial_us_per_batch: float | None = None
    serial_general_us_per_item: float | None = None
    serial_general_us_per_batch: float | None = None
    # the agent's own CPU per batch besides `agent_us_per_item` (a REQUEST frame parsed, a batch
    # formed and forwarded, credits): a + b / batch size, measured with it
    agent_us_per_batch: float | None = None

    def kernel(self, chain: tuple[str, ...] | str) -> KernelCost | None:
        key = chain if isinstance(chain, str) else "+".join(chain)
        return self.kernels.get(key)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "machine": self.machine,
            "date": self.date,
            "method": self.method,
            **({"basis": self.basis} if self.basis else {}),
            "kernels": {
                k: {
                    "a_ms": float(f"{c.a_ms:.5g}"),
                    "b_ms": float(f"{c.b_ms:.5g}"),
                    # fitted with the second feature (points of 3), even where it came out 0
                    **(
                        {"c_ms_per_byte": float(f"{c.c_ms:.5g}")}
                        if c.c_ms or any(len(p) == 3 for p in c.points)
                        else {}
                    ),
                    **(
                        {"progressive_x": float(f"{c.progressive_x:.4g}")}
                        if c.progressive_x is not None
                        else {}
                    ),
                    "unit": c.unit,
                    "points": [list(p) for p in c.points],
                }
                for k, c in sorted(self.kernels.items())
            },
            "links": {
                t: {
                    "latency_ms": c.latency_ms,
                    "bandwidth_bytes_per_s": c.bandwidth,
                    "cpu_ns_per_byte": c.cpu_ns_per_byte,
                    # None (measured before it was): left out, and read back as None
                    **(
                        {}
                        if c.cpu_us_per_batch is None
                        else {"cpu_us_per_batch": c.cpu_us_per_batch, "frame_mac": FRAME_MAC}
                    ),
                    **({"bandwidth_from": "process"} if c.across else {}),
                }
                for t, c in sorted(self.links.items())
            },
            **(
                {
                    "runtime": {
                        k: v
                        for k, v in zip(RUNTIME_KEYS, self._runtime_terms(), strict=True)
                        if v is not None
                    }
                }
                if any(v is not None for v in self._runtime_terms())
                else {}
            ),
        }

    def _runtime_terms(self) -> tuple[float | None, ...]:
        """The `runtime` figures in RUNTIME_KEYS order."""
        return (
            self.runtime_us_per_item,
            self.agent_us_per_item,
            self.serial_us_per_item,
            self.serial_us_per_batch,
            self.serial_general_us_per_item,
            self.serial_general_us_per_batch,
            self.agent_us_per_batch,
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _ratio(doc: dict, key: str, where: str, source: str) -> float:
    value = _number(doc, key, where, source)
    if value <= 0:
        raise ProfileError(
            f"{where}: '{key}' must be a ratio > 0, got {value!r}", Mark(source, 1, 1)
        )
    return value


def _number(doc: dict, key: str, where: str, source: str) -> float:
    value = doc.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ProfileError(
            f"{where}: '{key}' must be a number >= 0, got {value!r}", Mark(source, 1, 1)
        )
    return float(value)


def profile_from_json(doc: Any, source: str = "<profile>") -> Profile:
    """Check a profile document; any mistake is a ProfileError naming the entry."""
    mark = Mark(source, 1, 1)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f'not a nicoffload profile (no "format": "{FORMAT}")', mark)
    version = doc.get("version")
    if version not in (1, 2, 3, VERSION):
        raise ProfileError(f"profile version {version!r} is not {VERSION}; measure it again", mark)
    kind = doc.get("kind")
    if kind not in ("cpu", "dpu", "gpu"):
        raise ProfileError(f"'kind' must be cpu, dpu or gpu, got {kind!r}", mark)
    measured = str(doc.get("method", "")).startswith("measured")
    if version == 1 and measured and kind != "gpu" and "decode_image" in (doc.get("kernels") or {}):
        raise ProfileError(
            f"a version 1 profile: {STALE_DECODE}; measure it again with "
            f"`nicoffload profile --device {kind}`",
            mark,
        )
    kernels = {}
    for key, body in (doc.get("kernels") or {}).items():
        if not isinstance(body, dict):
            raise ProfileError(f"kernel '{key}' must be a mapping", mark)
        where = f"kernel '{key}'"
        raw = body.get("points", [])
        if not isinstance(raw, list) or not all(
            isinstance(p, list)
            and len(p) in (2, 3)
            and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                for x in p
            )
            for p in raw
        ):
            raise ProfileError(
                f"{where}: 'points' must be a list of [work, ms] or [work, ms, encoded bytes]",
                mark,
            )
        points = tuple(tuple(float(x) for x in p) for p in raw)
        kernels[key] = KernelCost(
            _number(body, "a_ms", where, source),
            _number(body, "b_ms", where, source),
            str(body.get("unit", "")),
            points,
            _number(body, "c_ms_per_byte", where, source) if "c_ms_per_byte" in body else 0.0,
            _ratio(body, "progressive_x", where, source) if "progressive_x" in body else None,
        )
    links = {}
    for name, body in (doc.get("links") or {}).items():
        where = f"link '{name}'"
        if not isinstance(body, dict):
            raise ProfileError(f"{where} must be a mapping", mark)
        links[name] = LinkCost(
            _number(body, "latency_ms", where, source),
            _number(body, "bandwidth_bytes_per_s", where, source) or 1.0,
            _number(body, "cpu_ns_per_byte", where, source),
            # profiles written before it was measured lack it, and a link measured under
            # another frame MAC has CPU figures of another cost: both priced by the defaults
            _number(body, "cpu_us_per_batch", where, source)
            if "cpu_us_per_batch" in body and body.get("frame_mac") == FRAME_MAC
            else None,
            body.get("bandwidth_from") == "process",
        )
    return Profile(
        kind,
        kernels,
        links,
        dict(doc.get("machine") or {}),
        str(doc.get("date", "")),
        str(doc.get("method", "")),
        str(doc.get("basis", "")),
        source,
        *_runtime(doc.get("runtime"), source),
    )


RUNTIME_KEYS = (
    "host_us_per_item",
    "agent_us_per_item",
    "serial_us_per_item",
    "serial_us_per_batch",
    "serial_general_us_per_item",
    "serial_general_us_per_batch",
    "agent_us_per_batch",
)


def _runtime(body: Any, source: str) -> tuple[float | None, ...]:
    """A profile's `runtime` figures in RUNTIME_KEYS order, each None if absent (a profile
    measured before it was). The serial pair is read as a pair: one without the other is a
    ProfileError (each path's)."""
    if body is None:
        return (None,) * len(RUNTIME_KEYS)
    if not isinstance(body, dict) or not body:
        raise ProfileError(
            "'runtime' must be a mapping with " + " or ".join(RUNTIME_KEYS), Mark(source, 1, 1)
        )
    unknown = sorted(set(body) - set(RUNTIME_KEYS))
    if unknown:
        raise ProfileError(
            f"runtime: unknown key '{unknown[0]}' (known: {', '.join(RUNTIME_KEYS)})",
            Mark(source, 1, 1),
        )
    for pair in (RUNTIME_KEYS[2:4], RUNTIME_KEYS[4:6]):
        serial = [k for k in pair if k in body]
        if len(serial) == 1:
            other = next(k for k in pair if k not in body)
            raise ProfileError(
                f"runtime: '{serial[0]}' without '{other}' (the host's serial time is a + b / "
                "batch size: both, or neither)",
                Mark(source, 1, 1),
            )
    return tuple(_number(body, k, "runtime", source) if k in body else None for k in RUNTIME_KEYS)


def load_profile(path: str | Path) -> Profile:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read the profile: {exc}", Mark(str(path), 1, 1)) from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"not JSON: {exc.msg}", Mark(str(path), exc.lineno, exc.colno)) from None
    return profile_from_json(doc, str(path))


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


def profile_path(name: str, base: Path | None = None) -> Path:
    """A shipped profile by name (`bluefield3-arm`), else a file path (relative to `base`)."""
    shipped = SHIPPED_DIR / f"{name}.json"
    if "/" not in name and not name.endswith(".json") and shipped.is_file():
        return shipped
    path = Path(name).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    if not path.is_file():
        raise LookupError(
            f"profile '{name}' is neither a shipped profile ({', '.join(shipped_names())}) nor a file"
        )
    return path


def profiles_dir() -> Path:
    """Where `nicoffload profile` writes this machine's profiles ($NICOFFLOAD_PROFILES)."""
    default = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nicoffload" / "profiles"
    )
    return Path(os.environ.get("NICOFFLOAD_PROFILES", default))


def measured_path(kind: str) -> Path:
    return profiles_dir() / f"{kind}.json"


def default_profile_for(kind: str) -> str:
    """This machine's measured profile of a kind if there is one, else the shipped estimate."""
    measured = measured_path(kind)
    return (
        str(measured) if measured.is_file() else str(SHIPPED_DIR / f"{SHIPPED_DEFAULT[kind]}.json")
    )
