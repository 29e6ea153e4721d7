"""`nicoffload loadgen`'s checks of --procs and --grpc, before anything is sent."""

from __future__ import annotations

from typer.testing import CliRunner

from nicoffload.cli import build_app

URL = "http://127.0.0.1:9/v2/models/m/infer"  # nothing listens: a check that sends would fail


def test_a_bad_grpc_address_is_refused_before_anything_is_sent():
    got = CliRunner().invoke(
        build_app(), ["loadgen", URL, "--rate", "1", "--sample", "1", "--grpc", "x"]
    )
    assert got.exit_code == 2 and "--grpc 'x': give HOST:PORT" in got.output


def test_procs_must_be_at_least_one():
    got = CliRunner().invoke(
        build_app(), ["loadgen", URL, "--rate", "1", "--sample", "1", "--procs", "0"]
    )
    assert got.exit_code == 2 and "--procs" in got.output
