"""The sizes of a run's real inputs, so that a plan is priced at them and not at the pipeline's
`typical` (the sample corpus goes up to 1920x1080 against resnet50's typical 500x375).

`typical_of` reads up to `limit` items: a JPEG's size from its header (nothing is decoded), any
bytes input's length, a text's characters; each input's typical is their mean (an image's
height is the mean height, its width the mean pixels over it, so that the mean pixel count,
which decode and resize cost, is kept). An item whose header cannot be read is left out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from nicoffload.graph import Pipeline

LIMIT = 256


# SOF markers of progressive JPEGs (Huffman or arithmetic, sequential or differential): their
# decode takes about 3x a baseline one's of the same image (`KernelCost.progressive_x`)
PROGRESSIVE_SOF = frozenset({0xC2, 0xC6, 0xCA, 0xCE})


def _jpeg_hw(data: bytes) -> tuple[int, int, int, int] | None:
    """(height, width, 1 if progressive else 0, 1 if the GPU decoder leaves it to the host
    else 0) from a JPEG's header; None for anything else."""
    import simplejpeg

    from nicoffload.ops.gpu_decode import jpeg_header, nvjpeg_takes

    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, TypeError):  # not a JPEG, or a corrupt one: its failure is the run's
        return None
    head = jpeg_header(data)
    progressive = head is not None and head[3] in PROGRESSIVE_SOF
    return int(h), int(w), int(progressive), int(not nvjpeg_takes(head))


def typical_of(
    pipeline: Pipeline, items: Iterable[tuple[str, Mapping[str, Any]]], limit: int = LIMIT
) -> dict[str, dict[str, Any]]:
    """Each input's typical size over the first `limit` items ({} for an input none had); for
    JPEGs, the share that are progressive too (`progressive`, 0-1, when any are)."""
    seen: dict[str, list[tuple[int, ...]]] = {name: [] for name in pipeline.inputs}
    for _, values in itertools.islice(items, limit):
        for name, value in values.items():
            spec = pipeline.inputs.get(name)
            if spec is None:
                continue
            if isinstance(value, str):
                seen[name].append((len(value),))
            elif isinstance(value, (bytes, bytearray, memoryview)):
                hw = _jpeg_hw(bytes(value)) if dict(spec.hints).get("format") == "jpeg" else None
                seen[name].append((len(value), *(hw or ())))
    out: dict[str, dict[str, int]] = {}
    for name, sizes in seen.items():
        if not sizes:
            continue
        if pipeline.inputs[name].dtype == "str":
            out[name] = {"chars": max(1, round(np.mean([s[0] for s in sizes])))}
            continue
        typical = {"bytes": max(1, round(np.mean([s[0] for s in sizes])))}
        images = [s[1:] for s in sizes if len(s) == 5]
        if images:
            h = float(np.mean([s[0] for s in images]))
            pixels = float(np.mean([s[0] * s[1] for s in images]))
            typical |= {"height": max(1, round(h)), "width": max(1, round(pixels / h))}
            share = float(np.mean([s[2] for s in images]))
            if share > 0:  # the share of progressive JPEGs (their decode costs more)
                typical["progressive"] = round(share, 3)
            host = float(np.mean([s[3] for s in images]))
            if host > 0:  # the share a GPU decoder leaves to the host (progressive included)
                typical["host_decoded"] = round(host, 3)
        out[name] = typical
    return out


def describe(typical: Mapping[str, Mapping[str, int]]) -> str:
    """One line for a plan's notes: what sizes it was priced at."""
    parts = []
    for name, t in sorted(typical.items()):
        if "height" in t:
            prog = f", {t['progressive']:.0%} progressive" if t.get("progressive") else ""
            if t.get("host_decoded", 0) > t.get("progressive", 0):
                prog += f", {t['host_decoded']:.0%} not for the GPU's batched decode"
            parts.append(f"'{name}' {t['height']}x{t['width']}, {t['bytes'] / 1e3:.0f} KB{prog}")
        elif "chars" in t:
            parts.append(f"'{name}' {t['chars']} characters")
        else:
            parts.append(f"'{name}' {t['bytes'] / 1e3:.0f} KB")
    return f"priced at the sizes of the inputs (means over up to {LIMIT} items): " + "; ".join(
        parts
    )
