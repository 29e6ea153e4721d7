"""What a YAML document may cost (yamlmarks, shared by the CLI and the agent's LOAD): aliases
add a bounded number of nodes and the alias that crosses the line is named at its mark; the
document's size and nesting are bounded; a bad scalar is a user error, not a traceback."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from nicoffload.errors import SpecError
from nicoffload.graph import load_pipeline
from nicoffload.yamlmarks import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    MAX_DOCUMENT_BYTES,
    alias_budget,
    load_marked,
    read_marked,
)

ROOT = Path(__file__).resolve().parents[2]


def laughs(levels: int, width: int = 9) -> str:
    """'Billion laughs': each level an anchored list of `width` aliases of the level before."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def test_nested_aliases_stop_at_the_alias_that_crosses_the_budget() -> None:
    text = laughs(9)  # 9^9 = 387 million strings if expanded
    assert len(text) < 500 and alias_budget(len(text)) == 1000
    # l1's aliases add 9 * 10 nodes, l2's 9 * 91 (909 in all), l3's first alias 820 more
    with pytest.raises(
        SpecError,
        match=r"^bomb\.yaml:4:10: alias '\*l2' takes the nodes added by aliases past 1000",
    ):
        load_marked(text, "bomb.yaml", SpecError)


def test_a_bomb_costs_bounded_memory_before_it_is_refused() -> None:
    text = laughs(12, width=12)
    tracemalloc.start()
    try:
        with pytest.raises(SpecError):
            load_marked(text, "bomb.yaml", SpecError)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_the_budget_grows_with_the_document_and_has_a_cap() -> None:
    assert alias_budget(10) == alias_budget(0) > 0
    assert alias_budget(50_000) == 50_000
    assert alias_budget(MAX_DOCUMENT_BYTES) == MAX_ALIAS_NODES


def test_a_pipeline_reusing_parameter_blocks_through_aliases_loads(tmp_path: Path) -> None:
    text = """name: aliases
inputs: {image: {kind: bytes, format: jpeg}}
nodes:
  - {name: decode, op: decode_image, in: image, params: &rgb {color: rgb}}
  - {name: resize, op: resize, in: decode, params: &resize {shorter: 256, antialias: true}}
  - {name: crop, op: center_crop, in: resize, params: {size: &square [224, 224]}}
  - name: resize2
    op: resize
    in: crop
    params: *resize
  - {name: crop2, op: center_crop, in: resize2, params: {size: *square}}
outputs: {pixels: crop2}
"""
    path = tmp_path / "aliases.yaml"
    path.write_text(text)
    p = load_pipeline(path)
    assert p.node("resize2").params == p.node("resize").params
    assert p.node("crop2").params["size"] == p.node("crop").params["size"]
    assert p.node("resize2").params["shorter"] == 256


def test_the_expansion_of_allowed_aliases_is_what_yaml_means() -> None:
    doc = load_marked("a: &x {k: [1, 2]}\nb: *x\nc: [*x, *x]\n", "x.yaml")
    assert doc["b"] == doc["a"] == {"k": [1, 2]} and doc["c"] == [doc["a"], doc["a"]]
    assert doc["b"] is not doc["a"]  # copies: a later change to one cannot reach the others


def test_an_alias_inside_its_own_anchor_is_refused_at_its_mark() -> None:
    with pytest.raises(SpecError, match=r"r\.yaml:2:5: alias '\*x' refers to itself"):
        load_marked("a: &x\n  - *x\n", "r.yaml", SpecError)


def test_an_undefined_alias_is_a_syntax_error_at_its_mark() -> None:
    with pytest.raises(SpecError, match=r"u\.yaml:2:4: YAML syntax: found undefined alias"):
        load_marked("a: &x 1\nb: *y\n", "u.yaml", SpecError)


def test_a_document_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("a: [" + "1, " * (MAX_DOCUMENT_BYTES // 3) + "1]\n")
    with pytest.raises(SpecError, match=r"big\.yaml:1:1: a YAML document may have at most"):
        read_marked(path, SpecError)
    with pytest.raises(SpecError, match="at most"):
        load_marked(path.read_text(), "big.yaml", SpecError)


def test_an_endless_file_is_read_no_further_than_the_limit() -> None:
    with pytest.raises(SpecError, match="may have at most"):
        read_marked("/dev/zero", SpecError)


def test_nesting_deeper_than_the_limit_is_refused() -> None:
    deep = "[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2)
    with pytest.raises(SpecError, match=f"d.yaml:1:{MAX_DEPTH + 2}: nested more than"):
        load_marked(deep, "d.yaml", SpecError)
    assert load_marked("[" * 20 + "]" * 20, "d.yaml") is not None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("2001-13-45", "month must be in 1..12"),
        ("!!int abc", "invalid literal"),
        ("1" * 5000, "Exceeds the limit"),
        ("!!binary zz", "failed to decode base64"),
    ],
)
def test_a_scalar_that_cannot_be_built_is_a_user_error_at_its_mark(value, problem) -> None:
    with pytest.raises(SpecError, match=rf"s\.yaml:2:4: bad value .*{problem}"):
        load_marked(f"a: 1\nb: {value}\n", "s.yaml", SpecError)
