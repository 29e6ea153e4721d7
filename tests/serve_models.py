"""User models for the serving tests: `nicoffload serve --model serve_models:NAME` with
PYTHONPATH=tests. `gated` records each call's rows in $SERVE_GATE_DIR/rows and, past the warm-up
call `serve` makes at start, says it was entered ($SERVE_GATE_DIR/entered) and blocks until
$SERVE_GATE_DIR/open exists: requests stay in flight for as long as a test needs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

_calls = 0


def gated(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    global _calls
    _calls += 1
    pixels = outputs["pixels"]
    if _calls > 1:  # not the warm-up call
        folder = Path(os.environ["SERVE_GATE_DIR"])
        with open(folder / "rows", "a") as f:
            f.write(f"{len(pixels)}\n")
        (folder / "entered").touch()
        while not (folder / "open").exists():
            time.sleep(0.01)
    return {"mean": pixels.astype(np.float32).mean(axis=(1, 2, 3))}
