"""A server's topology from Ray node records and a network file (no Ray needed: the records
are what `ray.nodes()` returns)."""

from __future__ import annotations

import pytest

from nicoffload.errors import TopologyError
from nicoffload.planner import plan_for
from nicoffload.ray.topology import cluster_topology, load_network, nodes_of


def node(nid: str, cpus: int = 2, gpus: int = 0, alive: bool = True, **labels: str) -> dict:
    labels = {f"nicoffload.io/{k.replace('_', '-')}": v for k, v in labels.items()}
    res = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
    return {"NodeID": nid, "Alive": alive, "Labels": labels, "Resources": res}


FLEET = [
    node("aa01", cpus=8, gpus=1, role="host", server="s0"),
    node("bb02", cpus=4, role="dpu", server="s0", dpu_gen="bf2"),
    node("cc03", cpus=16, role="cpu-pool"),
    node("dd04", cpus=8, role="host", server="s1"),
    node("ee05", cpus=4, role="dpu", server="s1"),
    node("ff06", cpus=4, role="cpu-pool", alive=False),
    node("0007", cpus=4),  # not labelled: not nicoffload's
]


def test_a_servers_topology_has_its_host_gpus_dpus_and_every_live_pool_node():
    found = cluster_topology(nodes_of(FLEET), server="s0")
    topo = found.topology
    kinds = {d.id: (d.kind, d.cores) for d in topo.devices}
    assert kinds == {"cpu": ("cpu", 8), "gpu0": ("gpu", 1), "dpu0": ("dpu", 4),
                     "dpu-pool-cc03": ("dpu", 16)}  # fmt: skip
    assert {d: n.id for d, n in found.agent_nodes.items()} == {
        "dpu0": "bb02",
        "dpu-pool-cc03": "cc03",
    }
    assert topo.device("dpu0").profile.endswith("bluefield2-arm.json")
    assert (topo.ingress, topo.egress) == ("cpu", "gpu0")
    transports = {(link.a, link.b): link.transport for link in topo.links}
    assert transports == {("cpu", "gpu0"): "pcie", ("dpu0", "cpu"): "tcp",
                          ("dpu-pool-cc03", "cpu"): "tcp"}  # fmt: skip


def test_the_planner_takes_a_cluster_topology():
    from nicoffload.graph import load_pipeline

    topo = cluster_topology(nodes_of(FLEET[:3])).topology
    plan = plan_for(load_pipeline("pipelines/resnet50.yaml"), topo)
    assert set(plan.placement.values()) <= set(topo.ids)


def test_two_servers_and_none_named_is_an_error_that_lists_them():
    with pytest.raises(TopologyError, match=r"2 servers .*s0, s1.*--ray-server"):
        cluster_topology(nodes_of(FLEET))


def test_an_unknown_server_is_an_error_that_lists_the_servers():
    with pytest.raises(TopologyError, match=r"'s9' has no live host node.*s0, s1"):
        cluster_topology(nodes_of(FLEET), server="s9")


def test_a_declared_network_sets_the_links_and_profiles_by_role(tmp_path):
    net = tmp_path / "net.yaml"
    net.write_text(
        "links:\n"
        "  - {between: [dpu, host], transport: tcp, bandwidth: 100Gb/s, latency: 10us}\n"
        "profiles: {cpu-pool: x86-server}\n"
    )
    found = cluster_topology(nodes_of(FLEET[:3]), load_network(net))
    link = next(k for k in found.topology.links if k.a == "dpu0")
    assert (link.bandwidth, link.latency_ms) == (100e9 / 8, 0.01)
    assert found.topology.device("dpu-pool-cc03").profile.endswith("x86-server.json")


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("links:\n  - {between: [gpu, host], transport: tcp, bandwidth: 1Gb/s}\n", 2, "between"),
        ("links:\n  - {between: [dpu, host], transport: pcie, bandwidth: 1Gb/s}\n", 2, "pcie"),
        ("links:\n  - {between: [dpu, host], transport: tcp, bandwidth: fast}\n", 2, "bandwidth"),
        ("profiles: {dpu: no-such-profile}\n", 1, "no-such-profile"),
        ("linkz: []\n", 1, "did you mean 'links'"),
    ],
)
def test_a_mistake_in_a_network_file_names_its_line(tmp_path, text, line, what):
    net = tmp_path / "net.yaml"
    net.write_text(text)
    with pytest.raises(TopologyError, match=what) as info:
        load_network(net)
    assert f"net.yaml:{line}:" in str(info.value)


def test_a_node_whose_agent_runs_already_gives_its_device_that_address():
    attached = node("bb02", cpus=4, role="dpu", server="s0", agent_port="7070")
    attached["NodeManagerAddress"] = "10.0.0.2"
    found = cluster_topology(nodes_of([FLEET[0], attached]))
    assert found.topology.device("dpu0").address == "10.0.0.2:7070"
    assert cluster_topology(nodes_of(FLEET[:2])).topology.device("dpu0").address is None
