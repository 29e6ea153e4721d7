"""`plan|run --ray`: the flags that go with it, and those it excludes, are checked before
anything connects."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nicoffload.cli import build_app

RESNET = "pipelines/resnet50.yaml"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", RESNET, "--ray-network", "net.yaml"], "--ray-network needs --ray ADDRESS"),
        (["plan", RESNET, "--ray-server", "s0"], "--ray-server needs --ray ADDRESS"),
        (["plan", RESNET, "--ray", "auto", "--topology", "t.yaml"], "--topology and --ray"),
        (["run", RESNET, "--sample", "2", "--ray", "auto", "--topology", "t.yaml"], "--topology"),
    ],
)
def test_a_flag_that_does_not_go_with_ray_is_refused_with_exit_2(args, message):
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 2
    assert message in result.output


def test_the_help_names_the_labels_the_topology_comes_from():
    result = CliRunner().invoke(build_app(), ["plan", "--help"], env={"COLUMNS": "200"})
    assert "nicoffload.io/role" in result.output
