"""Helpers for the placement-equivalence tests: pinned pipelines, a mixed corpus with bad items,
and the check that two runs of one pipeline agree bit for bit, row status included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from nicoffload.graph import Pipeline, load_pipeline
from nicoffload.inputs import sample_items


def pinned(source: str | Path | dict, pins: dict[str, str], folder: Path, name: str) -> Pipeline:
    """The pipeline with each node of `pins` allowed on that device kind only (no `slo`)."""
    doc = yaml.safe_load(Path(source).read_text()) if not isinstance(source, dict) else source
    doc = {k: v for k, v in doc.items() if k not in ("slo", "placement")}
    if pins:
        doc["placement"] = {node: [kind] for node, kind in pins.items()}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_pipeline(path)


def corpus(pipeline: Pipeline, n: int, seed: int = 3) -> list[tuple[str, dict[str, Any]]]:
    """`n` sample items plus bad ones: a truncated JPEG, random bytes, an empty text."""
    items = list(sample_items(pipeline, n, seed=seed))
    rng = np.random.default_rng(seed)
    bad = []
    for i, (name, values) in enumerate(items[:3]):
        broken = dict(values)
        for key, v in values.items():
            if isinstance(v, bytes):
                broken[key] = v[: len(v) // 3] if i == 0 else rng.bytes(2000)
            elif i == 2:
                broken[key] = ""
        bad.append((f"bad-{name}", broken))
    # the bad items sit between good ones, so that they share batches with them
    return items[: n // 2] + bad + items[n // 2 :]


def assert_same_run(got: Any, want: Any, what: str) -> None:
    """Two RunResults of one pipeline and corpus agree: names, row status with its reasons,
    and every output bit for bit (failed rows are zeros or None in both)."""
    assert got.names == want.names, what
    np.testing.assert_array_equal(got.ok, want.ok, err_msg=f"{what}: ok rows")
    reasons = {f.index: f.reason for f in got.failures}
    assert reasons == {f.index: f.reason for f in want.failures}, what
    assert set(got.outputs) == set(want.outputs), what
    for key, w in want.outputs.items():
        g = got.outputs[key]
        if isinstance(w, np.ndarray):
            assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {key}"
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: output '{key}'")
        else:
            assert len(g) == len(w), f"{what}: {key}"
            for i, (a, b) in enumerate(zip(g, w, strict=True)):
                if want.ok[i]:
                    np.testing.assert_array_equal(a, b, err_msg=f"{what}: {key}[{i}]")
