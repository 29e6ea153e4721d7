"""YAML loading that keeps where every key and value came from.

Pipeline and topology files are read through here so that every later error can point at
`file:line:col`. Mappings and sequences come back as dict/list subclasses carrying marks.
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


def _mark(file: str, m: yaml.Mark) -> Mark:
    return Mark(file, m.line + 1, m.column + 1)


def _convert(node: yaml.Node, file: str, error: type[UserError]) -> Any:
    if isinstance(node, yaml.MappingNode):
        out = MMap()
        out.mark, out.key_marks, out.value_marks = _mark(file, node.start_mark), {}, {}
        for key_node, value_node in node.value:
            key = _convert(key_node, file, error)
            if isinstance(key, (MMap, MSeq)):
                raise error("a mapping key must be a plain value", _mark(file, key_node.start_mark))
            if key in out:
                raise error(
                    f"duplicate key '{key}' (first at line {out.key_marks[key].line})",
                    _mark(file, key_node.start_mark),
                )
            out[key] = _convert(value_node, file, error)
            out.key_marks[key] = _mark(file, key_node.start_mark)
            out.value_marks[key] = _mark(file, value_node.start_mark)
        return out
    if isinstance(node, yaml.SequenceNode):
        seq = MSeq(_convert(n, file, error) for n in node.value)
        seq.mark = _mark(file, node.start_mark)
        seq.item_marks = [_mark(file, n.start_mark) for n in node.value]
        return seq
    return _SCALARS.construct_object(node)


def load_marked(text: str, file: str, error: type[UserError] = UserError) -> Any:
    """Parse YAML text into MMap/MSeq/scalars; syntax errors become `error` at their mark."""
    try:
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
    """Read and parse a YAML file; an unreadable file is a user error too."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
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
