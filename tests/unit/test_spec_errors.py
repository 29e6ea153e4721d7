"""Every mistake in a pipeline file is reported as `file:line:col: message`, exit code 2.

Each file in bad_pipelines/ states on its first line what `nicoffload validate` must say:
`# expect: LINE:COL: message fragment`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nicoffload.cli import build_app
from nicoffload.errors import SpecError
from nicoffload.graph import load_pipeline

BAD = sorted((Path(__file__).parent / "bad_pipelines").glob("*.yaml"))


def expectation(path: Path) -> tuple[int, int, str]:
    m = re.match(r"# expect: (\d+):(\d+): (.*)", path.read_text().splitlines()[0])
    assert m, f"{path.name} lacks its '# expect:' line"
    return int(m.group(1)), int(m.group(2)), m.group(3)


def test_the_catalogue_covers_at_least_fifteen_kinds_of_mistake():
    assert len(BAD) >= 15


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_pipeline_is_reported_at_its_line_and_column(path: Path):
    line, col, fragment = expectation(path)
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    err = info.value
    assert (err.mark.line, err.mark.column) == (line, col), str(err)
    assert fragment in err.message


@pytest.mark.parametrize("path", BAD[:3], ids=[p.stem for p in BAD[:3]])
def test_validate_exits_2_with_the_location_and_no_traceback(path: Path):
    line, col, fragment = expectation(path)
    result = CliRunner().invoke(build_app(), ["validate", str(path)])
    assert result.exit_code == 2
    assert f"{path}:{line}:{col}: {fragment}" in result.output
    assert "Traceback" not in result.output


def test_the_installed_command_reports_a_bad_file_on_stderr_with_exit_2():
    path = next(p for p in BAD if p.stem == "unknown_param")
    line, col, fragment = expectation(path)
    proc = subprocess.run(
        [sys.executable, "-m", "nicoffload", "validate", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"{path}:{line}:{col}: {fragment}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_missing_file_is_a_user_error():
    result = CliRunner().invoke(build_app(), ["validate", "nowhere.yaml"])
    assert result.exit_code == 2
    assert "nowhere.yaml:1:1: cannot read the file" in result.output


TOKENIZER_MISTAKES = [p for p in BAD if p.stem.startswith("tokenizer_")]


@pytest.mark.parametrize("command", [["validate"], ["plan"], ["run", "--sample", "1"]])
@pytest.mark.parametrize("path", TOKENIZER_MISTAKES, ids=[p.stem for p in TOKENIZER_MISTAKES])
def test_a_tokenizer_run_could_not_use_is_refused_by_validate_plan_and_run(path, command):
    line, col, fragment = expectation(path)
    result = CliRunner().invoke(build_app(), [command[0], str(path), *command[1:]])
    assert result.exit_code == 2, result.output
    assert f"{path}:{line}:{col}: node 'tok': parameter 'tokenizer': " in result.output
    assert fragment in result.output
    assert "Traceback" not in result.output
