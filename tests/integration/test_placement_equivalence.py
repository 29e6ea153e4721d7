"""Every placement the planner can produce gives the all-host run's outputs, bit for bit.

For each shipped pipeline: every pin of its nodes to the host or the DPU (all-cpu, all-dpu, and
every mix: host -> DPU, DPU -> host -> DPU, ...), and the unpinned plans of each objective;
then random small DAG pipelines with random pins. The DPU is one real agent process, named in
the topology as a real DPU, so every run connects, loads and streams as against a BlueField.
The corpus mixes good items with a truncated JPEG, random bytes and an empty text, so row
status (which rows are ok, and why the others failed) is compared too.
"""

from __future__ import annotations

import itertools
import json

import pytest
from equivalence import assert_same_run, corpus, pinned
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from split_plans import agent_topology, run_on_agent, token_agent

from nicoffload.errors import PlanError
from nicoffload.planner import plan_for
from nicoffload.planner.plan import single_device_plan

SHIPPED = ["pipelines/resnet50.yaml", "pipelines/bert.yaml", "pipelines/clip.yaml"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    with token_agent(tmp_path_factory.mktemp("agent")) as a:
        yield a


topology_for = agent_topology


run = run_on_agent


def what_runs(plan) -> str:
    """The plan as a run reads it: its JSON less the objective it was made for and how its
    search went (which nothing that runs it reads)."""
    doc = plan.to_json()
    return json.dumps({k: v for k, v in doc.items() if k not in ("objective", "search")})


def plans_of(path: str, folder, agent) -> dict[str, object]:
    """The plan of every pin of the pipeline's nodes over {cpu, dpu}, and each objective's
    where it is not one of those already (the same run again)."""
    topo = topology_for(agent)
    base = pinned(path, {}, folder, "base")
    names = [n.name for n in base.nodes]
    plans: dict[str, object] = {}
    for kinds in itertools.product(("cpu", "dpu"), repeat=len(names)):
        pins = dict(zip(names, kinds, strict=True))
        p = pinned(path, pins, folder, "pins-" + "-".join(kinds))
        try:
            plan = plan_for(p, topo)
        except PlanError:
            continue  # pins no placement can meet (a node neither device runs)
        plans[" ".join(f"{n}@{k}" for n, k in pins.items())] = plan
    runs = {what_runs(plan) for plan in plans.values()}
    for objective in ("throughput", "latency", "host-cpu"):
        plan = plan_for(base, topo, objective=objective)
        if what_runs(plan) not in runs:
            plans[objective] = plan
    return plans


@pytest.mark.parametrize("path", SHIPPED)
def test_every_placement_of_a_shipped_pipeline_equals_the_all_host_run(path, tmp_path, agent):
    pipeline = pinned(path, {}, tmp_path, "base")
    items = corpus(pipeline, 40)
    want = run(pipeline, items, single_device_plan(pipeline, "cpu"), agent)
    assert want.ok.sum() >= 40
    if any(spec.dtype == "bytes" for spec in pipeline.inputs.values()):
        assert not want.ok.all()  # the truncated JPEG and the random bytes fail
    plans = plans_of(path, tmp_path, agent)
    all_dpu = " ".join(f"{n.name}@dpu" for n in pipeline.nodes)
    assert all_dpu in plans  # the case that came back as zeros
    for what, plan in plans.items():
        got = run(pipeline, items, plan, agent)
        assert got.stats.failover is None, what
        assert_same_run(got, want, f"{path} {what} {dict(plan.placement)}")


IMAGE_OPS = st.fixed_dictionaries(
    {
        "resize": st.one_of(
            st.none(),
            st.fixed_dictionaries({"shorter": st.integers(40, 300)}),
            st.fixed_dictionaries({"size": st.tuples(st.integers(30, 200), st.integers(30, 200))}),
        ),
        "crop": st.one_of(st.none(), st.integers(20, 120)),
        "norm": st.one_of(st.none(), st.sampled_from(["float32", "float16"])),
        "layout": st.sampled_from(["chw", "hwc"]),
    }
)


def dag_doc(branches: list[dict], text: bool, outputs_mid: bool) -> dict:
    """A pipeline of image branches (decode -> [resize] -> [crop] -> [normalize]) and an
    optional text branch; `outputs_mid` also outputs each branch's decode (a ragged tensor)."""
    doc: dict = {"name": "random-dag", "inputs": {}, "nodes": [], "outputs": {}}
    doc["batch"] = {"max_size": 8, "max_wait_ms": 2}
    for i, b in enumerate(branches):
        doc["inputs"][f"img{i}"] = {"kind": "bytes", "format": "jpeg"}
        last = f"dec{i}"
        doc["nodes"].append({"name": last, "op": "decode_image", "in": f"img{i}"})
        if b["resize"] is not None:
            params = {k: list(v) if isinstance(v, tuple) else v for k, v in b["resize"].items()}
            doc["nodes"].append({"name": f"rs{i}", "op": "resize", "in": last, "params": params})
            last = f"rs{i}"
        if b["crop"] is not None:
            crop = {"size": b["crop"]}
            doc["nodes"].append({"name": f"cr{i}", "op": "center_crop", "in": last, "params": crop})
            last = f"cr{i}"
        if b["norm"] is not None:
            params = {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "dtype": b["norm"]}
            params["layout"] = b["layout"]
            doc["nodes"].append({"name": f"nm{i}", "op": "normalize", "in": last, "params": params})
            last = f"nm{i}"
        doc["outputs"][f"out{i}"] = last
        if outputs_mid and last != f"dec{i}":
            doc["outputs"][f"decoded{i}"] = f"dec{i}"
    if text:
        doc["inputs"]["text"] = {"kind": "text"}
        doc["nodes"].append(
            {"name": "tok", "op": "tokenize", "in": "text", "params": {"max_length": 16}}
        )
        doc["outputs"]["ids"] = "tok.input_ids"
    return doc


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    branches=st.lists(IMAGE_OPS, min_size=1, max_size=2),
    text=st.booleans(),
    outputs_mid=st.booleans(),
    pin_seed=st.integers(0, 2**16),
)
def test_a_random_dag_with_random_pins_equals_its_all_host_run(
    branches, text, outputs_mid, pin_seed, tmp_path, agent
):
    import random

    doc = dag_doc(branches, text, outputs_mid)
    base = pinned(doc, {}, tmp_path, "dag")
    rng = random.Random(pin_seed)
    pins = {n.name: rng.choice(["cpu", "dpu"]) for n in base.nodes}
    plan = plan_for(pinned(doc, pins, tmp_path, "dag-pinned"), topology_for(agent))
    items = corpus(base, 12, seed=pin_seed % 7)
    want = run(base, items, single_device_plan(base, "cpu"), agent)
    got = run(base, items, plan, agent)
    assert got.stats.failover is None
    assert_same_run(got, want, f"{doc} {dict(plan.placement)}")
