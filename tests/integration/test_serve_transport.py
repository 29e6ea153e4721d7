"""`nicoffload serve` of a plan whose DPU stage's outputs move to the host over the scheme its
physical decisions name (what bench_serve's `--transport` writes): the ready line says the
scheme the runtime read, and the tensors are the all-host run's. The local (emulated) agent."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tritonclient.http as httpclient
from serve_process import MODEL, PIPELINE, Served, host_plan
from split_plans import SPLIT, plan_of

import nicoffload
from nicoffload.planner import physical
from nicoffload.samples import sample_images
from nicoffload.topology import local_topology


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_a_plans_physical_scheme_is_what_serve_moves_the_dpu_stage_over(scheme, tmp_path):
    pipeline = nicoffload.load_pipeline(PIPELINE)
    plan = physical.complete(pipeline, plan_of(pipeline, SPLIT, topology="local"), local_topology())
    plan = dataclasses.replace(
        plan, physical={k: {**v, "scheme": scheme} for k, v in plan.physical.items()}
    )
    plan.save(tmp_path / "split.json")
    images = [b for _, b in sample_images(3, 4)]
    want = nicoffload.run(PIPELINE, images, plan=host_plan(tmp_path)).outputs["pixels"]
    s = Served(["--plan", str(tmp_path / "split.json")], tmp_path / "serve.log")
    try:
        assert s.doc["transports"] == dict.fromkeys(plan.physical, scheme)
        i = httpclient.InferInput("image", [len(images)], "BYTES")
        i.set_data_from_numpy(np.array(images, dtype=object))
        res = s.client.infer(MODEL, [i])
        assert res.as_numpy("pixels").tobytes() == want.tobytes()
        assert "dpu_us" in res.get_response()["parameters"]  # it went to the agent and back
    finally:
        assert s.stop() == 0


def test_a_host_only_plan_has_no_transport(tmp_path):
    s = Served(["--plan", str(host_plan(tmp_path))], tmp_path / "serve.log")
    try:
        assert s.doc["transports"] == {}
    finally:
        assert s.stop() == 0
