"""Where items come from: a folder of files, generated samples, or Python values.

An item is `(name, {input name: bytes or str})`. Files are read lazily, on the runtime's reader
thread, so reading overlaps processing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.errors import Mark, SpecError, UserError
from nicoffload.graph import Pipeline

TEXT_SUFFIXES = (".txt",)


def _kinds(pipeline: Pipeline) -> dict[str, str]:
    return {
        name: ("text" if spec.dtype == "str" else "bytes") for name, spec in pipeline.inputs.items()
    }


def _read(path: Path, kind: str) -> bytes | str:
    data = path.read_bytes()
    if kind == "text":
        return data.decode("utf-8", errors="replace")
    return data


def dir_items(
    pipeline: Pipeline, folder: str | Path
) -> tuple[int, Iterator[tuple[str, Mapping[str, Any]]]]:
    """(count, lazy items) for a folder.

    One input: every regular file is an item (text inputs read `*.txt`); the file's content, not
    its name, decides the format. Several inputs (an image and a text): files are grouped by
    stem, the `.txt` file feeding the text input and the other file the bytes input.
    """
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"--input: '{folder}' is not a folder", Mark(str(folder), 1, 1))
    kinds = _kinds(pipeline)
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    if len(kinds) == 1:
        ((name, kind),) = kinds.items()
        if kind == "text":
            files = [p for p in files if p.suffix.lower() in TEXT_SUFFIXES]
        paths = [(p.name, {name: p}) for p in files]
    else:
        text_inputs = [k for k, v in kinds.items() if v == "text"]
        byte_inputs = [k for k, v in kinds.items() if v == "bytes"]
        if len(text_inputs) > 1 or len(byte_inputs) > 1:
            raise SpecError(
                "reading a folder supports at most one text and one bytes input",
                Mark(pipeline.path, 1, 1),
            )
        groups: dict[str, dict[str, Path]] = {}
        for p in files:
            slot = (
                text_inputs[0]
                if p.suffix.lower() in TEXT_SUFFIXES and text_inputs
                else byte_inputs[0]
                if byte_inputs
                else None
            )
            if slot is not None:
                groups.setdefault(p.stem, {})[slot] = p
        missing = [stem for stem, g in groups.items() if len(g) != len(kinds)]
        if missing:
            raise UserError(
                f"--input: item '{missing[0]}' lacks a file for one of the inputs {sorted(kinds)} "
                f"(expected {missing[0]}.txt next to the image)",
                Mark(str(folder), 1, 1),
            )
        paths = sorted(groups.items())
    if not paths:
        raise UserError(f"--input: no input files in '{folder}'", Mark(str(folder), 1, 1))

    def gen() -> Iterator[tuple[str, Mapping[str, Any]]]:
        for item_name, group in paths:
            yield item_name, {k: _read(p, kinds[k]) for k, p in group.items()}

    return len(paths), gen()


def sample_items(pipeline: Pipeline, n: int, seed: int = 0) -> list[tuple[str, Mapping[str, Any]]]:
    """N generated items: realistic JPEGs for bytes inputs, English text for text inputs."""
    from nicoffload import samples

    kinds = _kinds(pipeline)
    columns: dict[str, list[tuple[str, Any]]] = {}
    for name, kind in kinds.items():
        columns[name] = (
            samples.sample_texts(n, seed) if kind == "text" else samples.sample_images(n, seed)
        )
    first = next(iter(columns.values()))
    return [
        (first[i][0].rsplit(".", 1)[0], {k: col[i][1] for k, col in columns.items()})
        for i in range(n)
    ]


def values_items(
    pipeline: Pipeline, values: Iterable[Any]
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Python values as items: a mapping per item, or bare values for one-input pipelines.

    An encoded file given as a 1-D uint8 numpy array (`np.fromfile`, a torch tensor's
    `.numpy()`) is passed on as a memoryview of it: the host's decoder read the array, but it
    went to an agent as a tensor, which the agent refuses where it reads bytes (`bad_request`),
    so the item's fate depended on where decode was placed."""
    names = list(pipeline.inputs)
    kinds = _kinds(pipeline)
    encoded = [n for n, kind in kinds.items() if kind == "bytes"]
    for i, v in enumerate(values):
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], Mapping):
            yield v[0], _as_bytes(v[1], encoded)
        elif isinstance(v, Mapping):
            yield str(i), _as_bytes(v, encoded)
        elif len(names) == 1:
            if isinstance(v, Path):
                v = _read(v, kinds[names[0]])
            yield str(i), _as_bytes({names[0]: v}, encoded)
        else:
            raise TypeError(
                f"item {i}: give a mapping of {names} for a pipeline with several inputs"
            )


def _as_bytes(values: Mapping[str, Any], encoded: list[str]) -> Mapping[str, Any]:
    """`values`, with each 1-D uint8 array among its `encoded` (bytes) inputs as a memoryview."""
    arrays = [n for n in encoded if _is_encoded_array(values.get(n))]
    if not arrays:
        return values
    return {**values, **{n: memoryview(np.ascontiguousarray(values[n])) for n in arrays}}


def _is_encoded_array(v: Any) -> bool:
    return isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.ndim == 1
