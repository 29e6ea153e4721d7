"""Scale-out on a local Ray cluster of three labelled nodes on this machine (a host head, a DPU
worker and a cpu-pool worker, one CPU and 100 MB of object store each): the topology from the
labels, agents as Ray actors placed by label selectors, runs equal to the all-host run bit for
bit, an agent actor killed mid-run and restarted, a node removed and the plan made again."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from split_plans import plan_of  # noqa: E402

import nicoffload  # noqa: E402
from nicoffload.errors import UserError  # noqa: E402
from nicoffload.graph import load_pipeline  # noqa: E402
from nicoffload.planner import plan_for  # noqa: E402
from nicoffload.planner.plan import single_device_plan  # noqa: E402
from nicoffload.ray.agents import AgentFleet  # noqa: E402
from nicoffload.ray.cluster import discover  # noqa: E402
from nicoffload.ray.topology import DPU_GEN, ROLE, SERVER  # noqa: E402
from nicoffload.runner import RunStats, prepare  # noqa: E402
from nicoffload.samples import sample_images  # noqa: E402
from nicoffload.session import Session  # noqa: E402

PIPELINE = load_pipeline("pipelines/resnet50.yaml")
NODE = {"num_cpus": 1, "object_store_memory": 100 << 20}


def pool_of(found) -> str:
    """The (only, or first) cpu-pool agent device of a discovered topology."""
    return min(d for d in found.agent_nodes if d.startswith("dpu-pool-"))


def across(found, pool: str | None = None) -> dict[str, str]:
    """Decode on the server's DPU, resize and crop on a pool node, normalize on the host."""
    pool = pool or pool_of(found)
    return {"decode": "dpu0", "resize": pool, "crop": pool, "norm": "cpu"}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "labels": {ROLE: "host", SERVER: "s0"}, "include_dashboard": False},
    )
    try:
        c.add_node(**NODE, labels={ROLE: "dpu", SERVER: "s0", DPU_GEN: "bf3"})
        c.add_node(**NODE, labels={ROLE: "cpu-pool"})
        ray.init(address=c.address, namespace="nicoffload-test", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def images():
    return [b for _, b in sample_images(24, seed=3)]


@pytest.fixture(scope="module")
def host_pixels(images):
    result = nicoffload.run(PIPELINE, images, plan=single_device_plan(PIPELINE, "cpu"))
    assert result.ok.all()
    return result.outputs["pixels"]


def remove(cluster, node) -> None:
    """Remove `node` and wait (30 s at most) until the cluster no longer lists it alive."""
    import time

    cluster.remove_node(node)
    deadline = time.monotonic() + 30
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the removed node is still listed alive"
        time.sleep(0.1)


def stream_killing(prep, items, kill, host_pixels):
    """Stream `items` (their names i0..) on a Session of `prep`, calling `kill` once the first
    batch is back; every item must come back once, in order, ok and equal to the all-host run."""
    stats = RunStats()
    names, pixels = [], []
    with Session(prep, workers=1) as session:
        feed = ((f"i{k}", {"image": b}) for k, b in enumerate(items))
        for i, batch in enumerate(session.stream(feed, stats)):
            if i == 0:
                kill()
            assert batch.ok.all()
            names.extend(batch.names)
            pixels.append(np.asarray(batch.numpy().outputs["pixels"]).copy())
    assert names == [f"i{k}" for k in range(len(items))]  # each once, in order
    times = len(items) // len(host_pixels)
    np.testing.assert_array_equal(np.concatenate(pixels), np.concatenate([host_pixels] * times))
    assert stats.items == len(items) and stats.errors == 0
    return stats


def plan_across(found, pool: str | None = None):
    return plan_of(PIPELINE, across(found, pool), topology=found.topology.name)


def test_the_topology_comes_from_the_nodes_labels(cluster):
    found = discover()
    topo, pool = found.topology, pool_of(found)
    nodes = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    assert found.server == "s0"
    assert {d.id: d.kind for d in topo.devices} == {"cpu": "cpu", "dpu0": "dpu", pool: "dpu"}
    assert nodes[found.agent_nodes["dpu0"].id][ROLE] == "dpu"
    assert nodes[found.agent_nodes[pool].id][ROLE] == "cpu-pool"
    assert pool == f"dpu-pool-{found.agent_nodes[pool].id[:8]}"
    assert topo.device("dpu0").profile.endswith("bluefield3-arm.json")  # from its dpu-gen label
    assert {(link.a, link.b) for link in topo.links} == {("dpu0", "cpu"), (pool, "cpu")}


def test_a_run_across_the_three_nodes_equals_the_all_host_run(cluster, images, host_pixels):
    found = discover()
    plan = plan_across(found)
    with AgentFleet(found, ["dpu0", pool_of(found)]) as fleet:
        # each agent listens on its own node, where its label selector put it
        for dev, d in fleet.descriptors.items():
            assert d["node_id"] == found.agent_nodes[dev].id
        prep = fleet.attach(prepare(PIPELINE, plan, found.topology))
        with Session(prep, workers=1) as session:
            result = session.run(images)
    assert result.ok.all() and result.stats.failover is None
    np.testing.assert_array_equal(result.outputs["pixels"], host_pixels)


def test_the_planners_plan_for_the_cluster_runs_equal_to_the_all_host_run(
    cluster, images, host_pixels
):
    found = discover()
    plan = plan_for(PIPELINE, found.topology)
    agents = [s.device for s in plan.stages if s.kind == "dpu"]
    with AgentFleet(found, agents) as fleet:
        result = nicoffload.run(PIPELINE, images, plan=plan, topology=fleet.topology(),
                                token_file=fleet.token_file, workers=1)  # fmt: skip
    assert result.ok.all() and result.stats.failover is None
    np.testing.assert_array_equal(result.outputs["pixels"], host_pixels)


def test_an_agent_actor_killed_mid_run_is_restarted_and_no_item_is_lost_or_doubled(
    cluster, images, host_pixels
):
    found = discover()
    plan = plan_across(found)
    many = images * 8  # 192 items: three batches of 64, the first back when the kill comes
    with AgentFleet(found, ["dpu0", pool_of(found)]) as fleet:
        before = fleet.descriptors["dpu0"]
        prep = fleet.attach(prepare(PIPELINE, plan, found.topology))
        stream_killing(prep, many, lambda: fleet.kill("dpu0"), host_pixels)
        after = fleet.refresh()["dpu0"]  # Ray made the actor again: a new agent on that node
        assert after["restarted"] and after["pid"] != before["pid"]
        assert after["node_id"] == before["node_id"]
        again = nicoffload.run(PIPELINE, images, plan=plan, topology=fleet.topology(),
                               token_file=fleet.token_file, workers=1)  # fmt: skip
    assert again.ok.all() and again.stats.failover is None  # served by the restarted agent
    np.testing.assert_array_equal(again.outputs["pixels"], host_pixels)


def test_an_agent_process_killed_mid_run_takes_its_actor_down_and_ray_restarts_both(
    cluster, images, host_pixels
):
    import os
    import signal
    import tempfile
    from pathlib import Path

    found = discover()
    plan = plan_of(PIPELINE, {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"},
                   topology=found.topology.name)  # fmt: skip
    with AgentFleet(found, ["dpu0"]) as fleet:
        before = fleet.descriptors["dpu0"]
        prep = fleet.attach(prepare(PIPELINE, plan, found.topology))
        stream_killing(
            prep, images * 8, lambda: os.kill(before["pid"], signal.SIGKILL), host_pixels
        )
        after = fleet.refresh()["dpu0"]
        assert after["restarted"] and after["pid"] != before["pid"]
        folder = Path(tempfile.gettempdir()) / f"nicoffload-ray-agent-{after['actor_id']}"
        assert folder.is_dir()  # the restarted agent's token: the crashed one's was replaced
    assert not folder.exists()  # and removed when the fleet stopped


def test_an_agent_already_running_on_a_node_is_attached_to_not_started(
    cluster, images, host_pixels, tmp_path
):
    from nicoffload.agent import auth
    from nicoffload.agent.local import LocalAgent
    from nicoffload.ray.topology import AGENT_PORT

    token = tmp_path / "agent.token"
    auth.write_token(token)
    ip = ray.util.get_node_ip_address()
    with LocalAgent(token, listen=f"{ip}:0", cores=1) as agent:  # as systemd would run it
        port = agent.address.rsplit(":", 1)[1]
        node = cluster.add_node(**NODE, labels={ROLE: "dpu", SERVER: "s0", AGENT_PORT: port})
        try:
            found = discover()
            (dev,) = [d for d, n in found.agent_nodes.items() if n.id == node.node_id]
            assert found.topology.device(dev).address == agent.address
            plan = plan_of(PIPELINE, {"decode": dev, "resize": dev, "crop": "cpu", "norm": "cpu"},
                           topology=found.topology.name)  # fmt: skip
            with pytest.raises(UserError, match="--token-file"):
                AgentFleet(found, [dev])
            with AgentFleet(found, [dev], token) as fleet:
                assert fleet.actors == {} and fleet.descriptors[dev]["attached"]
                prep = fleet.attach(prepare(PIPELINE, plan, found.topology))
                with Session(prep, workers=1) as session:
                    result = session.run(images)
                assert result.ok.all() and result.stats.failover is None
                np.testing.assert_array_equal(result.outputs["pixels"], host_pixels)
            assert agent.alive()  # attached, so left running
        finally:
            remove(cluster, node)


def test_a_node_removed_is_left_out_of_the_next_plan(cluster, images, host_pixels):
    before = discover()
    extra = cluster.add_node(**NODE, labels={ROLE: "cpu-pool"})
    with_it = discover()
    (added,) = set(with_it.topology.ids) - set(before.topology.ids)
    assert with_it.agent_nodes[added].id == extra.node_id
    old = plan_across(with_it, added)  # made while the node was there, and using it
    remove(cluster, extra)
    without = discover()
    assert without.topology.ids == before.topology.ids  # the others keep their ids
    with pytest.raises(UserError, match=added):
        prepare(PIPELINE, old, without.topology)  # refused, naming the device that left
    replanned = plan_for(PIPELINE, without.topology)
    assert set(replanned.placement.values()) <= set(without.topology.ids)
    agents = [s.device for s in replanned.stages if s.kind == "dpu"]
    with AgentFleet(without, agents) as fleet:
        result = nicoffload.run(PIPELINE, images, plan=replanned, topology=fleet.topology(),
                                token_file=fleet.token_file, workers=1)  # fmt: skip
    assert result.ok.all()
    np.testing.assert_array_equal(result.outputs["pixels"], host_pixels)


def test_run_with_ray_starts_the_plans_agents_on_the_cluster_and_reports_json(cluster):
    import json
    import subprocess
    import sys

    address = cluster.address
    cmd = [sys.executable, "-m", "nicoffload", "run", "pipelines/resnet50.yaml", "--sample", "8"]
    done = subprocess.run(
        [*cmd, "--ray", address, "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["items"] == 8 and doc["errors"] == 0 and doc["failover"] is None
    assert set(doc["placement"].values()) <= set(discover().topology.ids)
    for dev in {d for d in doc["placement"].values() if d.startswith("dpu")}:
        assert f"{dev}: agent at " in done.stderr  # started on its node as a Ray actor


def test_serve_with_ray_starts_the_plans_agents_on_the_cluster_serves_and_drains(
    cluster, images, host_pixels, tmp_path
):
    import tritonclient.http as httpclient
    from serve_process import MODEL, Served

    found = discover()
    plan = plan_across(found)  # decode on the server's DPU, resize and crop on the pool node
    plan.save(tmp_path / "plan.json")
    s = Served(["--plan", str(tmp_path / "plan.json"), "--ray", cluster.address], tmp_path / "log")
    try:
        placement = s.doc["placement"]
        assert placement == dict(plan.placement)
        dpus = {d for d in placement.values() if d.startswith("dpu")}
        assert len(dpus) == 2
        log = (tmp_path / "log").read_text()
        for dev in dpus:
            assert f"{dev}: agent at " in log  # started on its node as a Ray actor
        image = httpclient.InferInput("image", [len(images)], "BYTES")
        image.set_data_from_numpy(np.array(images, dtype=object))
        res = s.client.infer(MODEL, [image])
        assert res.as_numpy("pixels").tobytes() == np.stack(host_pixels).tobytes()
    finally:
        assert s.stop() == 0
    assert "failover" not in (tmp_path / "log").read_text()
