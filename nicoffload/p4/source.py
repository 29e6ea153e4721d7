"""A small reader of the P4 program's declarations, so tests check the program itself.

Not a P4 parser: it reads the subset `p4/nicoffload.p4` is written in (fixed-width `bit<N>`
fields, `@id` on tables, actions and counters, one control per block) and raises ValueError on a
declaration it does not understand rather than guess. Its users compare what it reads with
`frame.HEADER_FIELDS` and with the P4Info.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_BLOCK = re.compile(r"\b(header|struct)\s+(\w+)\s*\{([^{}]*)\}")
_MEMBER = re.compile(r"^(bit<(\d+)>|\w+)\s+(\w+)$")
_TYPEDEF = re.compile(r"\btypedef\s+bit<(\d+)>\s+(\w+)\s*;")
_CONST = re.compile(r"\bconst\s+bit<(\d+)>\s+(\w+)\s*=\s*(0x[0-9a-fA-F]+|\d+)\s*;")
_CONTROL = re.compile(r"\bcontrol\s+(\w+)\s*\(([^)]*)\)\s*\{")
_ACTION = re.compile(r"@id\((\d+)\)\s*action\s+(\w+)\s*\(([^)]*)\)")
_TABLE = re.compile(r"@id\((\d+)\)\s*table\s+(\w+)\s*\{")
_COUNTER = re.compile(
    r"@id\((\d+)\)\s*(direct_counter|counter)\s*\(\s*(?:(\d+)\s*,\s*)?CounterType\.(\w+)\s*\)\s*(\w+)\s*;"
)
_KEY = re.compile(r"([\w.]+)\s*:\s*(\w+)(?:\s*@name\(\"(\w+)\"\))?\s*;")


@dataclass(frozen=True)
class Action:
    id: int
    name: str  # Control.action, the P4Info name
    params: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Table:
    id: int
    name: str
    keys: tuple[tuple[str, str, int], ...]  # (control-plane name, match kind, bits)
    actions: tuple[tuple[str, str], ...]  # (action name, annotation: '', tableonly, defaultonly)
    size: int
    counters: str | None


@dataclass(frozen=True)
class Counter:
    id: int
    name: str
    direct: bool
    unit: str
    size: int | None


def _body(text: str, start: int) -> str:
    """The text between the `{` at `start - 1` and its matching `}`."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise ValueError("unbalanced braces")


class P4Source:
    """The declarations of one P4 program's text."""

    def __init__(self, text: str) -> None:
        self.text = _COMMENTS.sub("", text)
        self.typedefs = {m[2]: int(m[1]) for m in _TYPEDEF.finditer(self.text)}
        self.types: dict[str, tuple[tuple[str, str | int], ...]] = {}
        for kind, name, body in _BLOCK.findall(self.text):
            members = []
            for decl in filter(None, (d.strip() for d in body.split(";"))):
                m = _MEMBER.match(" ".join(decl.split()))
                if not m:
                    raise ValueError(f"{kind} {name}: cannot read member {decl!r}")
                width = int(m[2]) if m[2] else self.typedefs.get(m[1], m[1])
                members.append((m[3], width))
            self.types[name] = tuple(members)

    @classmethod
    def read(cls, path: str | Path) -> P4Source:
        return cls(Path(path).read_text())

    def header(self, name: str) -> tuple[tuple[str, int], ...]:
        """(field, bits) of a header or struct of plain bit<N> fields, in declaration order."""
        members = self.types[name]
        if not all(isinstance(w, int) for _, w in members):
            raise ValueError(f"{name} has a member that is not bit<N>: {members}")
        return members  # type: ignore[return-value]

    def constants(self) -> dict[str, int]:
        return {m[2]: int(m[3], 0) for m in _CONST.finditer(self.text)}

    def _width(self, params: dict[str, str], path: str) -> int:
        var, *rest = path.split(".")
        where: str | int = params[var]
        for part in rest:
            where = dict(self.types[str(where)])[part]
        if not isinstance(where, int):
            raise ValueError(f"{path} is not a bit<N> field")
        return where

    def _controls(self) -> list[tuple[str, dict[str, str], str]]:
        out = []
        for m in _CONTROL.finditer(self.text):
            params = {}
            for decl in m[2].split(","):
                words = decl.split()
                params[words[-1]] = words[-2]
            out.append((m[1], params, _body(self.text, m.end())))
        return out

    def actions(self) -> list[Action]:
        out = []
        for control, _, body in self._controls():
            for m in _ACTION.finditer(body):
                params = []
                for decl in filter(None, (d.strip() for d in m[3].split(","))):
                    kind, name = decl.split()
                    bits = re.fullmatch(r"bit<(\d+)>", kind)
                    params.append((name, int(bits[1]) if bits else self.typedefs[kind]))
                out.append(Action(int(m[1]), f"{control}.{m[2]}", tuple(params)))
        return out

    def tables(self) -> list[Table]:
        out = []
        for control, params, body in self._controls():
            for m in _TABLE.finditer(body):
                tbody = _body(body, m.end())
                key_at = re.search(r"\bkey\s*=\s*\{", tbody)
                act_at = re.search(r"\bactions\s*=\s*\{", tbody)
                if key_at is None or act_at is None:
                    raise ValueError(f"table {m[2]}: no key or actions")
                keys = tuple(
                    (k[3] or k[1], k[2], self._width(params, k[1]))
                    for k in _KEY.finditer(_body(tbody, key_at.end()))
                )
                actions = tuple(
                    (f"{control}.{a[2]}", a[1])
                    for a in re.finditer(r"(?:@(\w+)\s+)?(\w+)\s*;", _body(tbody, act_at.end()))
                )
                size = re.search(r"\bsize\s*=\s*(\d+)\s*;", tbody)
                counters = re.search(r"\bcounters\s*=\s*(\w+)\s*;", tbody)
                out.append(
                    Table(
                        int(m[1]),
                        f"{control}.{m[2]}",
                        keys,
                        tuple((name, note or "") for name, note in actions),
                        int(size[1]) if size else 1024,
                        f"{control}.{counters[1]}" if counters else None,
                    )
                )
        return out

    def counters(self) -> list[Counter]:
        return [
            Counter(
                int(m[1]),
                f"{control}.{m[5]}",
                m[2] == "direct_counter",
                m[4],
                int(m[3] or 0) or None,
            )
            for control, _, body in self._controls()
            for m in _COUNTER.finditer(body)
        ]
