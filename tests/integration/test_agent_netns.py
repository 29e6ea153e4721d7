"""The agent in its own network namespace, reached over a veth pair whose link delays and drops
packets: the whole pipeline still completes over TCP, bit for bit.

Delay and loss come from `tc netem` where the kernel has it. Where it does not (sch_netem not
built), the link is shaped by `tc tbf` (a slow link: queueing delay) and packets are dropped at
random by nftables (`numgen random`); the test says which it used. Needs root, `ip`, `tc`
(iproute2) and, without netem, `nft` (nftables).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.client import Client

ROOT = Path(__file__).resolve().parents[2]
RESNET = ROOT / "pipelines" / "resnet50.yaml"
TAG = f"{os.getpid() % 100000}"
NS, HOST_IF, NS_IF = f"nico{TAG}", f"nv{TAG}h", f"nv{TAG}n"
SUBNET = 100 + os.getpid() % 100
HOST_IP, NS_IP = f"10.213.{SUBNET}.1", f"10.213.{SUBNET}.2"
RATE, LOSS_PCT = "100mbit", 1
TABLE = f"nicoloss{TAG}"


def sh(*args: str, ns: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", "netns", "exec", NS, *args] if ns else list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10)


def must(*args: str, ns: bool = False) -> None:
    done = sh(*args, ns=ns)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr.strip()}"


def impair(dev: str, ns: bool) -> str:
    """Delay and loss on traffic through `dev` (netem, or tbf + nftables); says how. The nft
    table matches `dev` only, and the fixture deletes it: nothing else in the host is touched."""
    netem = f"netem delay 10ms 2ms loss {LOSS_PCT}%"
    if sh("tc", "qdisc", "add", "dev", dev, "root", *netem.split(), ns=ns).returncode == 0:
        return netem
    if shutil.which("nft") is None:
        pytest.skip(
            "no sch_netem in this kernel and no nft for random loss: apt-get install nftables"
        )
    must(*f"tc qdisc add dev {dev} root tbf rate {RATE} burst 16kb latency 50ms".split(), ns=ns)
    must(*f"nft add table inet {TABLE}".split(), ns=ns)
    hook = "{ type filter hook prerouting priority 0; }"
    must("nft", "add", "chain", "inet", TABLE, "in", hook, ns=ns)
    rule = f"nft add rule inet {TABLE} in iifname {dev} numgen random mod 100 < {LOSS_PCT} counter drop"
    must(*rule.split(), ns=ns)
    return f"tbf {RATE} (queueing delay) + nftables random drop {LOSS_PCT}% (no sch_netem here)"


@pytest.fixture(scope="module")
def link() -> Iterator[str]:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("needs root and iproute2 (ip, tc)")
    if sh("ip", "netns", "add", NS).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        must("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        must("ip", "link", "set", NS_IF, "netns", NS)
        must("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        must("ip", "link", "set", HOST_IF, "up")
        must("ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF, ns=True)
        must("ip", "link", "set", NS_IF, "up", ns=True)
        must("ip", "link", "set", "lo", "up", ns=True)
        # A short minimum RTO bounds the test's time: losses are recovered in tens of ms, not
        # in 200 ms steps that back off (the SYN's 1 s stays).
        subnet = f"10.213.{SUBNET}.0/24"
        must("ip", "route", "replace", subnet, "dev", HOST_IF, "rto_min", "20ms")
        must("ip", "route", "replace", subnet, "dev", NS_IF, "rto_min", "20ms", ns=True)
        how = impair(HOST_IF, ns=False)
        impair(NS_IF, ns=True)
        yield how
    finally:
        sh("nft", "delete", "table", "inet", TABLE)  # the host side's; the namespace's goes with it
        sh("ip", "link", "del", HOST_IF)
        sh("ip", "netns", "del", NS)


def test_pipeline_completes_over_a_delayed_lossy_link(link: str, tmp_path: Path) -> None:
    print(f"link impairment: {link}")
    token_file = tmp_path / "token"
    auth.write_token(token_file)
    rng = np.random.default_rng(1)
    images = []
    for i in range(6):
        img = rng.integers(0, 255, (40 + 2 * i, 50, 3), np.uint8).repeat(8, 0).repeat(8, 1)
        images.append(simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=90))
    ref = nicoffload.run(RESNET, images)
    prefix = ["ip", "netns", "exec", NS]
    retrans0 = retransmitted()
    with LocalAgent(token_file, listen=f"{NS_IP}:0", cores=1, prefix=prefix) as agent:
        assert agent.address.startswith(NS_IP)
        result = Client(agent.address, token_file, timeout=10).run(RESNET, images, transport="tcp")
    np.testing.assert_array_equal(result.outputs["pixels"], ref.outputs["pixels"])
    assert result.ok.all()
    resent = retransmitted() - retrans0
    print(f"dropped by the link: {dropped()} packets; the agent's TCP resent {resent} segments")
    assert "netem" in link or dropped() > 0, "the link dropped nothing: the impairment is off"


def dropped() -> int:
    """Packets the nftables rules dropped, on both ends of the link."""
    total = 0
    for ns in (False, True):
        text = sh("nft", "list", "table", "inet", TABLE, ns=ns).stdout
        total += sum(int(w) for w in re.findall(r"counter packets (\d+)", text))
    return total


def retransmitted() -> int:
    """TCP RetransSegs of the agent's namespace (/proc/net/snmp is per namespace)."""
    lines = [ln.split() for ln in sh("cat", "/proc/net/snmp", ns=True).stdout.splitlines()]
    names, values = (ln for ln in lines if ln[0] == "Tcp:")
    return int(values[names.index("RetransSegs")])
