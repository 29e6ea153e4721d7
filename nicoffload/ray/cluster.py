"""The connection to a Ray cluster, and a server's topology discovered from its live nodes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from nicoffload.errors import DeviceError
from nicoffload.ray import require_ray
from nicoffload.ray.topology import (
    ClusterTopology,
    Network,
    cluster_topology,
    load_network,
    nodes_of,
)

NAMESPACE = "nicoffload"


@contextlib.contextmanager
def connected(address: str | None) -> Iterator[None]:
    """Connected to the cluster at `address` (`auto`, `HOST:PORT`, `ray://...`) for the block;
    one this process was already connected to is left connected."""
    require_ray()
    import ray

    if ray.is_initialized():
        yield
        return
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise DeviceError(f"ray: cannot connect to the cluster at {address}: {exc}") from exc
    try:
        yield
    finally:
        ray.shutdown()


def discover(
    network: str | Path | Network | None = None, server: str | None = None
) -> ClusterTopology:
    """Server `server`'s topology from the connected cluster's live nodes (see
    `topology.cluster_topology`), its links from `network` (a file, or the defaults)."""
    import ray

    if isinstance(network, (str, Path)):
        network = load_network(network)
    return cluster_topology(nodes_of(ray.nodes()), network, server)
