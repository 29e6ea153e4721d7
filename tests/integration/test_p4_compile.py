"""p4/nicoffload.p4 compiles with p4c's BMv2 back end, cleanly, into build/p4/, to the P4Info
shipped beside it and to a header that is frame.py's field for field."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("p4.v1", reason="the P4Info comparison needs the 'p4' extra (p4runtime)")

from nicoffload.p4 import P4_SOURCE, P4INFO
from nicoffload.p4._proto import proto
from nicoffload.p4.p4info import P4Info
from nicoffload.p4.toolchain import (
    BUILD_DIR,
    REQUIRE_ENV,
    Compiled,
    CompileError,
    Tools,
    ToolsMissing,
    compile_program,
    find_tools,
)
from nicoffload.transport.frame import HEADER_FIELDS


@pytest.fixture(scope="module")
def tools() -> Tools:
    try:
        return find_tools(switch=False)
    except ToolsMissing as exc:
        if os.environ.get(REQUIRE_ENV):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def compiled(tools: Tools) -> Compiled:
    return compile_program(P4_SOURCE, BUILD_DIR, tools)  # a CompileError carries p4c's message


def test_the_program_compiles_into_the_build_folder_without_an_error_or_a_warning(
    compiled: Compiled,
) -> None:
    assert compiled.diagnostics == ""
    assert compiled.json.parent == BUILD_DIR and compiled.p4info.parent == BUILD_DIR
    assert json.loads(compiled.json.read_text())["program"].endswith("nicoffload.p4")


def test_the_p4info_p4c_writes_is_the_shipped_one_in_canonical_form(compiled: Compiled) -> None:
    generated, shipped = P4Info.load(compiled.p4info), P4Info.load(P4INFO)
    text = proto().text_format.MessageToString
    assert text(generated.canonical()) == text(shipped.message)


def test_the_header_bmv2_parses_is_frame_pys_field_for_field(compiled: Compiled) -> None:
    config = json.loads(compiled.json.read_text())
    types = {t["name"]: t for t in config["header_types"]}
    fields = [(name, bits) for name, bits, _signed in types["nicoffload_t"]["fields"]]
    assert fields == list(HEADER_FIELDS)


def test_a_program_p4c_refuses_fails_with_p4cs_message_naming_the_line(tools, tmp_path) -> None:
    text = P4_SOURCE.read_text()
    broken = text.replace("bit<16> stage_id;", "bit<16> stage_id", 1)
    assert broken != text
    bad = tmp_path / "broken.p4"
    bad.write_text(broken)
    line = broken[: broken.index("bit<16> stage_id\n")].count("\n") + 1
    with pytest.raises(CompileError) as exc:
        compile_program(bad, tmp_path / "out", tools)
    message = str(exc.value)
    assert f"p4c failed on {bad}" in message
    # p4c notices the missing ';' at the next declaration
    assert f"broken.p4({line + 1}):syntax error" in message, message
    assert not (tmp_path / "out" / "broken.json").exists()
