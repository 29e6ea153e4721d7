"""`run --output DIR` is replaced as a whole by a run that succeeds, and left as it was by one
that fails, crashes or is interrupted: never old reports beside new (or zero) arrays."""

from __future__ import annotations

import errno
import importlib
import json
import os
import signal

import numpy as np
import pytest
from test_cli_run import TEXT_PIPELINE, images, invoke, pipeline_file

from nicoffload.errors import SystemFailure

cli_run = importlib.import_module("nicoffload.cli.run")


def contents(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(out):
    """What a run left beside its output folder: temporary or old folders."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.fixture
def previous(tmp_path):
    """An output folder written by a successful run, and its files' bytes."""
    out = tmp_path / "out"
    result = invoke(
        pipeline_file(tmp_path), "--input", images(tmp_path, 3, name="first"), "--output", out
    )
    assert result.exit_code == 0, result.output
    return out, contents(out)


def stream_then(exc):
    """The real stream, raising `exc` after its first batch."""
    real = cli_run.stream

    def stream(*args, **kwargs):
        for batch in real(*args, **kwargs):
            yield batch
            raise exc

    return stream


def test_a_successful_run_writes_the_folder_and_leaves_nothing_beside_it(previous):
    out, files = previous
    assert set(files) == {"pixels.npy", "items.json", "summary.json"}
    assert np.load(out / "pixels.npy").shape == (3, 8, 8, 3)
    assert [i["ok"] for i in json.loads(files["items.json"])] == [True] * 3
    assert leftovers(out) == []


def test_a_run_whose_items_all_fail_leaves_the_previous_output_untouched(tmp_path, previous):
    out, files = previous
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, 0, 3), "--output", out)
    assert result.exit_code == 1, result.output
    assert contents(out) == files
    assert f"the previous contents of {out} are untouched" in result.stderr
    assert leftovers(out) == []


def test_a_run_that_crashes_midway_leaves_the_previous_output_untouched(
    tmp_path, previous, monkeypatch
):
    out, files = previous
    monkeypatch.setattr(cli_run, "stream", stream_then(SystemFailure("runtime: a worker failed")))
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, 4), "--output", out)
    assert result.exit_code == 1, result.output
    assert "nicoffload: failure: runtime: a worker failed" in result.stderr
    assert f"the previous contents of {out} are untouched" in result.stderr
    assert contents(out) == files
    assert leftovers(out) == []


def test_an_interrupted_run_leaves_the_previous_output_untouched(tmp_path, previous, monkeypatch):
    out, files = previous
    monkeypatch.setattr(cli_run, "stream", stream_then(KeyboardInterrupt()))
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, 4), "--output", out)
    assert result.exit_code == 130, result.output
    assert f"the previous contents of {out} are untouched" in result.stderr
    assert contents(out) == files
    assert leftovers(out) == []


def test_outputs_stream_into_a_hidden_folder_beside_the_target_until_the_run_succeeds(
    tmp_path, previous, monkeypatch
):
    out, files = previous
    seen = []

    def check():
        (partial,) = [out.parent / n for n in leftovers(out)]
        seen.append(sorted(p.name for p in partial.iterdir()))
        assert contents(out) == files  # mid-run, the target is still the previous run's

    real = cli_run.stream

    def stream(*args, **kwargs):
        for batch in real(*args, **kwargs):
            yield batch
            check()

    monkeypatch.setattr(cli_run, "stream", stream)
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, 4), "--output", out)
    assert result.exit_code == 0, result.output
    assert seen and seen[0] == ["pixels.npy"]  # memory-mapped, filled as batches arrive
    assert np.load(out / "pixels.npy").shape == (4, 8, 8, 3)
    assert leftovers(out) == []


def test_a_successful_run_replaces_the_previous_output_as_a_whole(tmp_path, previous):
    out, _ = previous
    result = invoke(pipeline_file(tmp_path, TEXT_PIPELINE), "--sample", 2, "--output", out)
    assert result.exit_code == 0, result.output
    assert set(contents(out)) == {"ids.npy", "items.json", "summary.json"}  # no pixels.npy
    assert json.loads((out / "summary.json").read_text())["items"] == 2


def test_strict_with_a_failed_item_creates_no_output_folder(tmp_path):
    out = tmp_path / "new" / "deeper" / "out"
    folder = images(tmp_path, 2, 1)
    result = invoke(pipeline_file(tmp_path), "--input", folder, "--output", out, "--strict")
    assert result.exit_code == 1, result.output
    assert f"--output: nothing was written; {out} was not created" in result.stderr
    assert not (tmp_path / "new").exists()  # nor the folders made to hold it


def test_an_output_path_that_is_a_file_is_refused_with_exit_2(tmp_path):
    out = tmp_path / "out"
    out.write_text("mine")
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path), "--output", out)
    assert result.exit_code == 2, result.output
    assert f"{out}:1:1: --output: '{out}' exists and is not a folder" in result.stderr
    assert out.read_text() == "mine"


def test_a_folder_holding_other_files_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "data.npy").write_bytes(b"mine too")
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path), "--output", out)
    assert result.exit_code == 2, result.output
    assert f"--output: '{out}' is a folder that is not a previous run's output (notes.txt)" in (
        result.stderr
    )
    assert contents(out) == {"data.npy": b"mine too", "notes.txt": b"mine"}
    assert leftovers(out) == []


def test_an_empty_folder_is_filled(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path), "--output", out)
    assert result.exit_code == 0, result.output
    assert set(contents(out)) == {"pixels.npy", "items.json", "summary.json"}


def test_a_folder_that_cannot_be_made_is_a_user_error_naming_the_path(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    real = os.mkdir

    def mkdir(path, *args, **kwargs):  # as a folder without write permission answers
        if str(path).startswith(str(locked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    out = locked / "out"
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path), "--output", out)
    assert result.exit_code == 2, result.output
    assert f"--output: cannot create a folder beside '{out}' ({locked}): Permission denied" in (
        result.stderr
    )
    assert "Traceback" not in result.output


def test_an_output_that_cannot_be_put_in_place_is_a_user_error_and_untouched(
    tmp_path, previous, monkeypatch
):
    out, files = previous

    def refuse(new, target):
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    monkeypatch.setattr("nicoffload.outputs.replace_folder", refuse)
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, 2), "--output", out)
    assert result.exit_code == 2, result.output
    assert f"--output: cannot put the outputs in place of '{out}' ({out}): Permission denied" in (
        result.stderr
    )
    assert f"the previous contents of {out} are untouched" in result.stderr
    assert contents(out) == files
    assert leftovers(out) == []


def test_a_full_disk_is_found_before_the_run_and_leaves_nothing(tmp_path, previous, monkeypatch):
    out, files = previous

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, 2), "--output", out)
    assert result.exit_code == 2, result.output
    assert f"--output: cannot write into a folder beside '{out}'" in result.stderr
    assert "No space left on device" in result.stderr
    assert contents(out) == files
    assert leftovers(out) == []


def test_a_terminated_run_leaves_the_previous_output_untouched(tmp_path, previous, monkeypatch):
    out, files = previous

    def not_unwound(signum, frame):  # what the run sees if SIGTERM does not unwind it
        raise RuntimeError("SIGTERM reached the test's own handler")

    previous_handler = signal.signal(signal.SIGTERM, not_unwound)
    real = cli_run.stream

    def stream(*args, **kwargs):
        for batch in real(*args, **kwargs):
            yield batch
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` or a scheduler's time limit

    monkeypatch.setattr(cli_run, "stream", stream)
    try:
        result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path, 4), "--output", out)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    assert result.exit_code == 143, result.output
    assert "nicoffload: terminated" in result.stderr
    assert f"the previous contents of {out} are untouched" in result.stderr
    assert contents(out) == files
    assert leftovers(out) == []


def test_a_folder_of_arrays_without_a_runs_reports_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "pixels.npy").write_bytes(b"someone's arrays, or a crashed run's zeros")
    result = invoke(pipeline_file(tmp_path), "--input", images(tmp_path), "--output", out)
    assert result.exit_code == 2, result.output
    assert "is a folder that is not a previous run's output (no items.json or summary.json)" in (
        result.stderr
    )
    assert contents(out) == {"pixels.npy": b"someone's arrays, or a crashed run's zeros"}
