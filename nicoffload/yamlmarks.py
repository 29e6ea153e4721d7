"""YAML loading that keeps where every key and value came from.

Pipeline and topology files are read through here so that every later error can point at
`file:line:col`. Mappings and sequences come back as dict/list subclasses carrying marks.
The CLI and the agent (whose LOAD carries a client's YAML) share it, so it bounds what a document
may cost: its size, its nesting, and the nodes its aliases add (no "billion laughs").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nicoffload.errors import Mark, UserError


class MMap(dict):
    """A YAML mapping: `mark` of the mapping, `key_marks[k]` and `value_marks[k]` per key."""

    mark: Mark
    key_marks: dict[Any, Mark]
    value_marks: dict[Any, Mark]

    def mark_of(self, key: Any) -> Mark:
        """The value's mark when the key is present, else the mapping's own mark."""
        return self.value_marks.get(key, self.mark)


class MSeq(list):
    """A YAML sequence: `mark` of the sequence, `item_marks[i]` per item."""

    mark: Mark
    item_marks: list[Mark]


# One constructor for scalars only: it keeps no state between calls for plain scalar nodes.
_SCALARS = yaml.SafeLoader("")
# libyaml's parser where PyYAML has it: the same nodes and marks, ~10x sooner (a 200-node
# pipeline: 0.3 s in pure Python)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

MAX_DOCUMENT_BYTES = 1 << 20  # a 2000-node pipeline is 200 KB
MAX_DEPTH = 100  # nested mappings and sequences; pipelines use fewer than 10
# Aliases may add as many nodes as the document has bytes (at least ALIAS_NODES_FLOOR, at most
# MAX_ALIAS_NODES): a few reused parameter blocks fit many times over; nested aliases that
# double at each level ("billion laughs": 400 bytes, 10^9 nodes) are stopped at the alias that
# crosses the line, before anything is copied.
ALIAS_NODES_FLOOR = 1_000
MAX_ALIAS_NODES = 100_000


def alias_budget(document_bytes: int) -> int:
    """How many nodes the aliases of a document of this size may add, in all."""
    return min(MAX_ALIAS_NODES, max(ALIAS_NODES_FLOOR, document_bytes))


def _mark(file: str, m: yaml.Mark) -> Mark:
    return Mark(file, m.line + 1, m.column + 1)


def _check_aliases(text: str, size: int, file: str, error: type[UserError]) -> None:
    """Walk the parser's events (no nodes built) and refuse the first alias that would make the
    aliases add more than `alias_budget(size)` nodes, or that names an anchor still open (a
    cycle). An anchored node's expanded size is the count of nodes between its start and end."""
    budget = alias_budget(size)
    sizes: dict[str, int] = {}  # anchor -> nodes it expands to
    open_: list[tuple[str | None, int]] = []  # collections being read: (anchor, nodes before)
    nodes = added = 0
    for ev in yaml.parse(text, Loader=_LOADER):
        if isinstance(ev, yaml.AliasEvent):
            if any(anchor == ev.anchor for anchor, _ in open_):
                raise error(f"alias '*{ev.anchor}' refers to itself", _mark(file, ev.start_mark))
            n = sizes.get(ev.anchor, 1)  # undefined: yaml.compose says so, at this mark
            added += n
            nodes += n
            if added > budget:
                raise error(
                    f"alias '*{ev.anchor}' takes the nodes added by aliases past {budget} "
                    f"(the limit for a document of {size} bytes); write the values out",
                    _mark(file, ev.start_mark),
                )
        elif isinstance(ev, yaml.CollectionStartEvent):
            open_.append((ev.anchor, nodes))
            nodes += 1
        elif isinstance(ev, yaml.CollectionEndEvent):
            anchor, before = open_.pop()
            if anchor is not None:
                sizes[anchor] = nodes - before
        elif isinstance(ev, yaml.ScalarEvent):
            nodes += 1
            if ev.anchor is not None:
                sizes[ev.anchor] = 1


def _convert(node: yaml.Node, file: str, error: type[UserError], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise error(f"nested more than {MAX_DEPTH} levels deep", _mark(file, node.start_mark))
    if isinstance(node, yaml.MappingNode):
        out = MMap()
        out.mark, out.key_marks, out.value_marks = _mark(file, node.start_mark), {}, {}
        for key_node, value_node in node.value:
            key = _convert(key_node, file, error, depth + 1)
            if isinstance(key, (MMap, MSeq)):
                raise error("a mapping key must be a plain value", _mark(file, key_node.start_mark))
            if key in out:
                raise error(
                    f"duplicate key '{key}' (first at line {out.key_marks[key].line})",
                    _mark(file, key_node.start_mark),
                )
            out[key] = _convert(value_node, file, error, depth + 1)
            out.key_marks[key] = _mark(file, key_node.start_mark)
            out.value_marks[key] = _mark(file, value_node.start_mark)
        return out
    if isinstance(node, yaml.SequenceNode):
        seq = MSeq(_convert(n, file, error, depth + 1) for n in node.value)
        seq.mark = _mark(file, node.start_mark)
        seq.item_marks = [_mark(file, n.start_mark) for n in node.value]
        return seq
    try:
        return _SCALARS.construct_object(node)
    except (ValueError, yaml.YAMLError) as exc:  # 2001-13-45, !!int abc, 5000 digits, !!binary
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        value = node.value if len(node.value) <= 40 else node.value[:37] + "..."
        raise error(f"bad value {value!r}: {problem}", _mark(file, node.start_mark)) from None


def _too_big(file: str, error: type[UserError]) -> UserError:
    return error(
        f"a YAML document may have at most {MAX_DOCUMENT_BYTES} bytes; this one has more",
        Mark(file, 1, 1),
    )


def load_marked(text: str, file: str, error: type[UserError] = UserError) -> Any:
    """Parse YAML text into MMap/MSeq/scalars; syntax errors, a document over
    MAX_DOCUMENT_BYTES and aliases over `alias_budget` become `error` at their mark."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_DOCUMENT_BYTES:
        raise _too_big(file, error)
    try:
        if "&" in text:  # no anchor, no alias that resolves
            _check_aliases(text, size, file, error)
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        m = exc.problem_mark or exc.context_mark
        where = _mark(file, m) if m else Mark(file, 1, 1)
        raise error(f"YAML syntax: {exc.problem or exc.context}", where) from None
    except yaml.YAMLError as exc:
        raise error(f"YAML syntax: {exc}", Mark(file, 1, 1)) from None
    if node is None:
        raise error("the file is empty", Mark(file, 1, 1))
    return _convert(node, file, error)


def read_marked(path: str | Path, error: type[UserError] = UserError) -> Any:
    """Read and parse a YAML file; an unreadable or oversize file is a user error too."""
    p = Path(path)
    try:
        with p.open("rb") as f:  # a bounded read: /dev/zero or a 10 GB file costs 1 MiB
            data = f.read(MAX_DOCUMENT_BYTES + 1)
        if len(data) > MAX_DOCUMENT_BYTES:
            raise _too_big(str(p), error)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read the file: {exc}", Mark(str(p), 1, 1)) from None
    return load_marked(text, str(p), error)


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """' (did you mean 'x'?)' for the nearest choice, or a list of what exists."""
    import difflib

    near = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    if near:
        return f" (did you mean '{near[0]}'?)"
    return f" (expected one of: {', '.join(sorted(map(str, choices)))})" if choices else ""
