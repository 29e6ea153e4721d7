"""The connection to a Ray cluster, and a server's topology discovered from its live nodes."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from nicoffload.errors import DeviceError, UserError
from nicoffload.ray import require_ray
from nicoffload.ray.topology import (
    ClusterTopology,
    Network,
    cluster_topology,
    load_network,
    nodes_of,
)

NAMESPACE = "nicoffload"
PROBE_S = 5.0  # to connect to the head's port before ray.init is asked to


@contextlib.contextmanager
def connected(address: str | None) -> Iterator[None]:
    """Connected to the cluster at `address` (`auto`, `HOST:PORT`, `ray://...`) for the block;
    one this process was already connected to is left connected."""
    require_ray()
    import ray

    reachable(address)  # ray.init retries an address where nothing listens for minutes
    if ray.is_initialized():
        yield
        return
    # ray.init sets a SIGTERM handler of its own (sys.exit(15)) and leaves it after shutdown:
    # ours is kept (SIGTERM unwinds the command, "terminated", exit 143; serve drains)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise DeviceError(f"ray: cannot connect to the cluster at {address}: {exc}") from exc
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    try:
        yield
    finally:
        ray.shutdown()


def reachable(address: str | None, timeout: float = PROBE_S) -> None:
    """A HOST:PORT where nothing accepts a connection is a DeviceError at once; an address
    that is not one of `auto`, HOST:PORT or ray://HOST:PORT is the user's mistake."""
    if address in (None, "auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--ray: {address!r} is not auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise DeviceError(
            f"ray: nothing answers at {address} ({exc.strerror or exc}): is the head node "
            "started (`ray start --head`), and is that its GCS port (6379 by default)?"
        ) from None


def discover(
    network: str | Path | Network | None = None, server: str | None = None
) -> ClusterTopology:
    """Server `server`'s topology from the connected cluster's live nodes (see
    `topology.cluster_topology`), its links from `network` (a file, or the defaults)."""
    import ray

    if isinstance(network, (str, Path)):
        network = load_network(network)
    return cluster_topology(nodes_of(ray.nodes()), network, server)
