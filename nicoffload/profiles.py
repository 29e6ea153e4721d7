"""Cost profiles: what each kernel costs on a device (`a + b * work` ms per item) and what each
link transport costs, as JSON with the machine, date and method written in.

`nicoffload profile` measures them (see `measure`); devices that cannot be measured here (a
BlueField's Arm cores) ship as documented estimates in `nicoffload/data/profiles/`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, ProfileError

FORMAT = "nicoffload-profile"
VERSION = 1
SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "profiles"
# The shipped estimate used for a device kind when this machine has no measured profile.
SHIPPED_DEFAULT = {"cpu": "x86-server", "dpu": "bluefield3-arm", "gpu": "h100"}


@dataclass(frozen=True)
class KernelCost:
    """ms per item of one kernel (one op, or a fused chain `a+b+c`) on one core: a + b * work."""

    a_ms: float
    b_ms: float
    unit: str  # pixels | bytes | tokens
    points: tuple[tuple[float, float], ...] = ()  # (work, measured ms) the fit came from

    def ms(self, work: float) -> float:
        return self.a_ms + self.b_ms * work


@dataclass(frozen=True)
class LinkCost:
    """A transport as measured on a machine; topology files may override any of it."""

    latency_ms: float
    bandwidth: float  # bytes per second, each direction
    cpu_ns_per_byte: float  # CPU time at each CPU endpoint


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
                }
                for t, c in sorted(self.links.items())
            },
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _number(doc: dict, key: str, where: str, source: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ProfileError(
            f"{where}: '{key}' must be a number >= 0, got {value!r}", Mark(source, 1, 1)
        )
    return float(value)


def profile_from_json(doc: Any, source: str = "<profile>") -> Profile:
    """Check a profile document; any mistake is a ProfileError naming the entry."""
    mark = Mark(source, 1, 1)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f'not a nicoffload profile (no "format": "{FORMAT}")', mark)
    if doc.get("version") != VERSION:
        raise ProfileError(
            f"profile version {doc.get('version')!r} is not {VERSION}; measure it again", mark
        )
    kind = doc.get("kind")
    if kind not in ("cpu", "dpu", "gpu"):
        raise ProfileError(f"'kind' must be cpu, dpu or gpu, got {kind!r}", mark)
    kernels = {}
    for key, body in (doc.get("kernels") or {}).items():
        if not isinstance(body, dict):
            raise ProfileError(f"kernel '{key}' must be a mapping", mark)
        where = f"kernel '{key}'"
        points = tuple((float(w), float(t)) for w, t in body.get("points", ()))
        kernels[key] = KernelCost(
            _number(body, "a_ms", where, source),
            _number(body, "b_ms", where, source),
            str(body.get("unit", "")),
            points,
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
    )


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
