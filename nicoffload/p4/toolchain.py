"""p4c's BMv2 back end and BMv2's `simple_switch`: compile the program, run it on pcap files.

The tools are not in any package registry these machines reach; they are prebuilt beside the
repository in `../shared/p4tools` (`NICOFFLOAD_P4TOOLS` names another folder). `ToolsMissing`
says what is absent, so tests can skip with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nicoffload.errors import SystemFailure
from nicoffload.p4 import P4_DIR

TOOLS_ENV = "NICOFFLOAD_P4TOOLS"
# Set (by `make test`, as root with the tools beside the clone): missing tools fail, not skip.
REQUIRE_ENV = "NICOFFLOAD_REQUIRE_P4"
# Outputs go here, never into the tools' (read-only) folder; build/ is git-ignored.
BUILD_DIR = P4_DIR.parent / "build" / "p4"


class ToolsMissing(SystemFailure):
    """The P4 tools, a shared library they need or the `thrift` package are absent."""


class CompileError(SystemFailure):
    """p4c refused the program; the message is p4c's."""


@dataclass(frozen=True)
class Tools:
    root: Path

    @property
    def p4c(self) -> Path:
        return self.root / "bin" / "p4c-bmv2"

    @property
    def simple_switch(self) -> Path:
        return self.root / "bin" / "simple_switch"

    @property
    def cli(self) -> Path:
        """simple_switch's runtime CLI, run with this interpreter (which has `thrift`)."""
        return self.root / "py" / "sswitch_CLI.py"

    @property
    def pythonpath(self) -> Path:
        return self.root / "py"


def tools_root() -> Path:
    """../shared/p4tools relative to the repository root, wherever the clone is."""
    return Path(os.environ.get(TOOLS_ENV) or P4_DIR.parent.parent / "shared" / "p4tools")


def _check_runs(binary: Path, packages: Path) -> None:
    """ToolsMissing if `binary --version` fails: a shared library absent, most likely."""
    try:
        run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolsMissing(f"{binary} cannot start: {exc}") from exc
    if run.returncode != 0:
        raise ToolsMissing(
            f"{binary} does not run: {(run.stderr or run.stdout).strip()} (install the "
            f"packages listed in {packages})"
        )


def find_tools(*, switch: bool = True) -> Tools:
    """The tools, checked to run here; ToolsMissing naming what to install otherwise."""
    tools = Tools(tools_root())
    need = [tools.p4c] + ([tools.simple_switch, tools.cli] if switch else [])
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        raise ToolsMissing(
            f"no P4 tools: {', '.join(missing)} not found (they live in ../shared/p4tools "
            f"beside the repository, or where {TOOLS_ENV} says)"
        )
    for binary in [tools.p4c] + ([tools.simple_switch] if switch else []):
        _check_runs(binary, tools.root / "apt-packages.txt")
    if switch and importlib.util.find_spec("thrift") is None:
        raise ToolsMissing("BMv2's runtime CLI needs the 'thrift' package (the 'dev' extra)")
    return tools


@dataclass(frozen=True)
class Compiled:
    json: Path  # the BMv2 configuration
    p4info: Path  # the P4Info p4c wrote (text format)
    diagnostics: str  # p4c's warnings; empty for a clean compile


def compile_program(
    source: Path, out_dir: Path = BUILD_DIR, tools: Tools | None = None
) -> Compiled:
    """Compile `source` for BMv2 (v1model) into `out_dir`; CompileError with p4c's message.

    The outputs are written beside and moved into place, so concurrent compiles of the same
    program into one folder never leave a half-written file there.
    """
    tools = tools or find_tools(switch=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = source.stem
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".p4c-") as tmp:
        json, p4info = Path(tmp, f"{stem}.json"), Path(tmp, f"{stem}.p4info.txtpb")
        cmd = [tools.p4c, "--arch", "v1model", "--std", "p4-16", "--p4runtime-files", p4info]
        try:
            run = subprocess.run(
                [*cmd, "-o", json, source], capture_output=True, text=True, timeout=300
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CompileError(f"p4c ({tools.p4c}) did not run: {exc}") from exc
        message = (run.stderr + run.stdout).strip()
        if run.returncode != 0:
            raise CompileError(f"p4c failed on {source} (exit {run.returncode}):\n{message}")
        for made in (json, p4info):
            os.replace(made, out_dir / made.name)
    return Compiled(out_dir / json.name, out_dir / p4info.name, message)
