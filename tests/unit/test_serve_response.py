"""A binary response built from outputs in place (`kserve_out.response_parts(copy=False)`, what
the HTTP endpoint does for a small binary answer): the same body as from copies, the outputs
read once, when the body is assembled."""

from __future__ import annotations

import numpy as np

from nicoffload.serve import kserve_out
from nicoffload.serve.kserve import InferRequest

REQ = InferRequest(None, {}, binary_output=True)


def outputs() -> dict[str, np.ndarray]:
    return {
        "pixels": np.arange(3 * 4 * 5, dtype="<f2").reshape(1, 3, 4, 5),
        "label": np.array([7], "<i8"),
    }


def test_the_body_from_views_is_the_body_from_copies():
    outs = outputs()
    copied = kserve_out.assemble_response(kserve_out.response_parts("m", REQ, outs), {"a_us": 1})
    viewed = kserve_out.assemble_response(
        kserve_out.response_parts("m", REQ, outs, copy=False), {"a_us": 1}
    )
    assert viewed == copied


def test_without_copy_the_blobs_are_the_outputs_until_assembled():
    outs = outputs()
    parts = kserve_out.response_parts("m", REQ, outs, copy=False)
    outs["pixels"][...] = 1.5  # written after the parts, before the body: the body has it
    body, headers = kserve_out.assemble_response(parts)
    n = int(headers["Inference-Header-Content-Length"])
    got = np.frombuffer(body[n : n + outs["pixels"].nbytes], "<f2")
    assert (got == 1.5).all()
