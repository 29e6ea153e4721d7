"""`run --output DIR`: outputs written as plain numpy files, loadable with `numpy.load`.

DIR/<output>.npy    one array per pipeline output, shape (items, *item_shape), item order;
                    rows of failed items are zero (np.load(..., mmap_mode="r") works)
DIR/items.json      [{"index", "name", "ok", "reason", "detail"}] in item order
DIR/summary.json    the `run --json` document

A run writes into a temporary folder beside DIR (`.DIR.partial-*`, on the same filesystem) and
puts it in place of DIR, as a whole, only once the run has succeeded; a run that fails or is
interrupted removes it and leaves DIR as it was. DIR must be new, empty, or a previous run's
output: a folder holding anything else is refused rather than replaced.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from nicoffload.errors import Mark, SystemFailure, UserError
from nicoffload.graph import Pipeline
from nicoffload.runtime.executor import Batch

REPORTS = ("items.json", "summary.json")


class OutputWriter:
    """Writes batches into preallocated .npy files as they arrive (no whole-run buffering), in
    a temporary folder that `commit` puts in place of the target; leaving the `with` block
    without committing removes it, and an exception leaving it gets a note saying so."""

    def __init__(self, folder: str | Path, pipeline: Pipeline, count: int) -> None:
        self.shown = str(folder)  # as the user wrote it, for messages
        specs = pipeline.output_specs()
        ragged = [k for k, s in specs.items() if not s.static]
        if ragged:
            raise UserError(
                f"--output: output '{ragged[0]}' ({specs[ragged[0]]}) has a shape that varies per item; "
                "end the pipeline with a fixed-size op (center_crop, resize with size) to write it",
                Mark(pipeline.path, 1, 1),
            )
        self.target = Path(folder).resolve()  # a symlink's folder is replaced, not the link
        self.existed = check_target(self.target, self.shown)
        self.made = [p for p in (self.target.parent, *self.target.parent.parents) if not p.exists()]
        self.count = count
        self.items: list[dict[str, Any]] = []
        self.arrays: dict[str, np.memmap] = {}
        self.tmp: Path | None = None
        self.committed = False
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = _sibling(self.target, "partial")
        except OSError as exc:
            self._remove_made()
            raise self._oserror("cannot create a folder beside", exc) from None
        try:
            for k, s in specs.items():
                path = self.tmp / f"{k}.npy"
                self.arrays[k] = np.lib.format.open_memmap(
                    path, mode="w+", dtype=s.dtype, shape=(count, *s.shape)
                )
                _reserve(path)
        except OSError as exc:
            self.abort()
            raise self._oserror("cannot write into a folder beside", exc) from None

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.committed:
            self.abort()
            if exc is not None:
                exc.add_note(self.untouched())

    def write(self, batch: Batch) -> None:
        end = batch.start + len(batch)
        for k, arr in self.arrays.items():
            arr[batch.start : end] = batch.outputs[k]
        failed = {f.index: f for f in batch.failures}
        for i, name in enumerate(batch.names):
            f = failed.get(batch.start + i)
            self.items.append(
                {"index": batch.start + i, "name": name, "ok": f is None}
                | ({"reason": f.reason, "detail": f.detail} if f else {})
            )

    def commit(self, summary: dict[str, Any]) -> None:
        """Finish the files and put the folder in place of the target, as a whole."""
        self.items.sort(key=lambda item: item["index"])
        if [item["index"] for item in self.items] != list(range(self.count)):
            raise SystemFailure(
                f"runtime: the run delivered {len(self.items)} rows for {self.count} items "
                "(some missing or twice); its outputs are not written"
            )
        assert self.tmp is not None
        try:
            for arr in self.arrays.values():
                arr.flush()
            self.arrays = {}  # unmapped: the files are complete
            _write_synced(self.tmp / "items.json", json.dumps(self.items, indent=1) + "\n")
            _write_synced(self.tmp / "summary.json", json.dumps(summary, indent=2) + "\n")
        except OSError as exc:
            raise self._oserror("cannot write into a folder beside", exc) from None
        try:
            old = replace_folder(self.tmp, self.target)
        except OSError as exc:
            raise self._oserror("cannot put the outputs in place of", exc) from None
        self.committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Remove the temporary folder (and the parents made for it); the target is untouched."""
        self.arrays = {}
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self._remove_made()

    def untouched(self) -> str:
        if self.existed:
            return f"--output: nothing was written; the previous contents of {self.shown} are untouched"
        return f"--output: nothing was written; {self.shown} was not created"

    def _remove_made(self) -> None:
        for p in self.made:  # the deepest first
            try:
                p.rmdir()
            except OSError:
                break

    def _oserror(self, what: str, exc: OSError) -> UserError:
        where = exc.filename or self.target.parent
        return UserError(
            f"--output: {what} '{self.shown}' ({where}): {exc.strerror or exc}",
            Mark(self.shown, 1, 1),
        )


def check_target(target: Path, shown: str) -> bool:
    """Whether the target exists; refuse one that is not a folder, or a folder that holds
    anything a run does not write (a run replaces the folder as a whole: that would be lost)."""
    if not target.exists():
        if target.is_symlink():
            raise UserError(f"--output: '{shown}' is a broken symbolic link", Mark(shown, 1, 1))
        return False
    if not target.is_dir():
        raise UserError(
            f"--output: '{shown}' exists and is not a folder; give a folder", Mark(shown, 1, 1)
        )
    try:
        names = sorted(p.name for p in target.iterdir())
    except OSError as exc:
        raise UserError(
            f"--output: cannot read '{shown}': {exc.strerror or exc}", Mark(shown, 1, 1)
        ) from None
    foreign = [n for n in names if n not in REPORTS and not n.endswith(".npy")]
    if names and (foreign or not set(REPORTS) <= set(names)):
        example = foreign[0] if foreign else f"no {' or '.join(sorted(set(REPORTS) - set(names)))}"
        raise UserError(
            f"--output: '{shown}' is a folder that is not a previous run's output ({example}); "
            "a run replaces the whole folder, so give a new or empty folder",
            Mark(shown, 1, 1),
        )
    return True


def replace_folder(new: Path, target: Path) -> Path | None:
    """Put folder `new` in place of `target` (absent or a folder); return where the old target
    now is (to remove), or None. Where the system swaps two paths in one step (Linux), no
    moment exists at which `target` is absent or mixed; elsewhere two renames, undone if the
    second fails."""
    if not target.exists():
        os.rename(new, target)
        _sync_folder(target.parent)
        return None
    if _exchange(new, target):
        _sync_folder(target.parent)
        return new
    old = _sibling(target, "old")
    os.rename(target, old)  # onto the empty folder just made
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    _sync_folder(target.parent)
    return old


def _sibling(target: Path, what: str) -> Path:
    """A new empty folder beside `target`: hidden, and made as mkdir makes any folder (the
    umask's mode, where a temporary folder would be private to its owner)."""
    path = target.parent / f".{target.name}.{what}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where that is not offered."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # the kernel or filesystem lacks it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _reserve(path: Path) -> None:
    """Give a new (sparse) .npy file its blocks now: a full disk is then an error here, where
    writing rows into a memory map on a full disk would kill the process (SIGBUS)."""
    if not hasattr(os, "posix_fallocate"):
        return
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it
                raise


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (where folders can be opened to sync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
