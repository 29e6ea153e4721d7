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


def test_a_ray_address_where_nothing_listens_fails_at_once_naming_it():
    import socket

    from nicoffload.errors import DeviceError
    from nicoffload.ray.cluster import reachable

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DeviceError, match=f"nothing answers at 127.0.0.1:{port}"):
        reachable(f"127.0.0.1:{port}")


@pytest.mark.parametrize("address", ["nowhere", "host:port", "host:70000", ":6379"])
def test_a_ray_address_that_is_not_host_port_is_the_users_mistake(address):
    from nicoffload.errors import UserError
    from nicoffload.ray.cluster import reachable

    with pytest.raises(UserError, match="is not auto, HOST:PORT"):
        reachable(address)


def test_the_core_and_its_command_line_import_no_ray():
    import subprocess
    import sys

    code = (
        "import sys, nicoffload; from nicoffload.cli import build_app; build_app(); "
        "import nicoffload.ray.topology; sys.exit('ray' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
