"""The planner has no notion of runnable shapes: the runtime runs every placement, so a plan is
the best overall whatever its stages look like (a GPU stage that goes back to the host, a DPU
stage after the host), with no note about its shape, and the runtime takes it as it is (the
fast path for its shapes, the general path for the others). `runnable=` is a no-op."""

from __future__ import annotations

from pathlib import Path

import pytest

from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for
from nicoffload.runtime.chain import Chain, executor_for, fast_path

# A host, an emulated DPU where requests enter, and an H200 (its measured profile): for
# throughput the best placement decodes on the GPU and comes back to the host.
TOPOLOGY = """\
name: gpu-box
ingress: dpu0
egress: cpu
devices:
  cpu: {kind: cpu, cores: 8, memory: 64GiB, profile: x86-server}
  dpu0: {kind: dpu, cores: 8, memory: 64GiB, profile: x86-server}
  gpu0: {kind: gpu, memory: 140GiB, profile: h200}
links:
  - {between: [cpu, gpu0], transport: pcie, bandwidth: 55GB/s, latency: 10us}
  - {between: [cpu, dpu0], transport: tcp, bandwidth: 10GB/s, latency: 30us}
"""


@pytest.fixture
def topo(tmp_path: Path) -> Path:
    path = tmp_path / "gpu-box.yaml"
    path.write_text(TOPOLOGY)
    return path


def test_the_best_plan_overall_is_planned_whatever_its_shape(topo: Path) -> None:
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    plan = plan_for(pipeline, topo)
    assert [s.kind for s in plan.stages] == ["gpu", "cpu"]  # back from the GPU to the host
    assert not any("shape" in n for n in plan.notes)
    assert plan.search["method"] == "dynamic programming" and plan.search["gap"] == 0
    assert not fast_path(plan)


def test_runnable_is_accepted_and_changes_nothing(topo: Path) -> None:
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    for objective in ("throughput", "latency", "host-cpu"):
        free = plan_for(pipeline, topo, objective=objective)
        asked = plan_for(pipeline, topo, objective=objective, runnable=True)
        assert asked.placement == free.placement and asked.notes == free.notes


def test_a_plan_going_back_to_the_host_runs_on_the_general_path() -> None:
    from split_plans import plan_of

    pipeline = load_pipeline("pipelines/resnet50.yaml")
    plan = plan_of(pipeline, {"decode": "cpu", "resize": "cpu", "crop": "cpu", "norm": "cpu"})
    with executor_for(pipeline, plan, workers=1) as ex:
        assert not isinstance(ex, Chain)  # the fast path keeps its shapes
    back = plan_of(pipeline, {"decode": "gpu0", "resize": "cpu", "crop": "cpu", "norm": "cpu"})
    with executor_for(pipeline, back, workers=1, gpu_stages={"s0-gpu0": _NoGpu()}) as ex:
        assert isinstance(ex, Chain)


class _NoGpu:
    """Enough of a GPU stage to be built around (nothing runs)."""

    def __init__(self) -> None:
        self.inputs, self.outputs = ["image"], ["decode"]

    def close(self) -> None:
        pass


def test_the_runnable_flag_is_a_no_op_that_says_so(topo: Path) -> None:
    import json

    from typer.testing import CliRunner

    from nicoffload.cli import build_app

    args = ["plan", "pipelines/resnet50.yaml", "--topology", str(topo), "--json"]
    plain = CliRunner().invoke(build_app(), args)
    flagged = CliRunner().invoke(build_app(), [*args, "--runnable"])
    assert plain.exit_code == flagged.exit_code == 0, flagged.output
    assert "--runnable/--any-shape is a no-op" in flagged.stderr
    assert json.loads(flagged.stdout)["placement"] == json.loads(plain.stdout)["placement"]
