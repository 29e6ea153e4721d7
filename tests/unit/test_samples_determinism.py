"""Sample item i depends only on (seed, i): the same bytes in every process, whatever else
that process made before."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np

from nicoffload import samples

DIGEST = (
    "import hashlib, sys; from nicoffload.samples import sample_image; "
    "[sample_image(i) for i in range(int(sys.argv[1]))]; "
    "print(hashlib.sha256(sample_image(102)[1]).hexdigest())"
)


def test_a_cell_larger_than_every_source_photo_is_filled_whole():
    tile = samples._tile(np.random.default_rng(0), 4000, 3000)
    assert tile.shape == (4000, 3000, 3)


def test_an_item_is_the_same_in_every_process():
    # item 102 (1080x1920) has cells no scaled photo covers: they were left uninitialised
    there = subprocess.run(
        [sys.executable, "-c", DIGEST, "5"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert there == hashlib.sha256(samples.sample_image(102)[1]).hexdigest()
