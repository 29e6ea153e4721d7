"""nicoffload.outputs: the folder swap behind `run --output`, and a run's rows checked whole."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
from test_cli_run import pipeline_file

from nicoffload import outputs
from nicoffload.errors import SystemFailure
from nicoffload.graph import load_pipeline


def folder(path, **files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def names(path):
    return {p.name: p.read_text() for p in path.iterdir()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_replace_folder_swaps_in_one_step_on_linux(tmp_path, monkeypatch):
    new, target = folder(tmp_path / "new", a="new"), folder(tmp_path / "out", b="old")

    def no_rename(*args):
        raise AssertionError("two renames, where one exchange does it")

    monkeypatch.setattr(os, "rename", no_rename)
    old = outputs.replace_folder(new, target)
    assert names(target) == {"a": "new"}
    assert old is not None and names(old) == {"b": "old"}


def test_replace_folder_renames_twice_where_no_exchange_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    new, target = folder(tmp_path / "new", a="new"), folder(tmp_path / "out", b="old")
    old = outputs.replace_folder(new, target)
    assert names(target) == {"a": "new"}
    assert old is not None and names(old) == {"b": "old"}
    assert not new.exists()


def test_replace_folder_puts_the_target_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    new, target = folder(tmp_path / "new", a="new"), folder(tmp_path / "out", b="old")
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(16, "Device or resource busy", str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        outputs.replace_folder(new, target)
    assert names(target) == {"b": "old"}
    assert names(new) == {"a": "new"}


@dataclass
class Rows:
    """The part of a runtime batch the writer reads."""

    start: int
    names: list[str]
    outputs: dict[str, np.ndarray]
    failures: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)


def test_a_run_that_delivered_fewer_rows_than_items_writes_nothing(tmp_path):
    pipeline = load_pipeline(pipeline_file(tmp_path))
    target = tmp_path / "out"
    rows = Rows(0, ["a", "b"], {"pixels": np.ones((2, 8, 8, 3), np.uint8)})
    with (
        pytest.raises(SystemFailure, match="delivered 2 rows for 3 items"),
        outputs.OutputWriter(target, pipeline, 3) as writer,
    ):
        writer.write(rows)
        writer.commit({"items": 3})
    assert not target.exists()
    assert os.listdir(tmp_path) == ["image.yaml"]
