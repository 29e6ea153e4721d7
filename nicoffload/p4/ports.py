"""The NIC port (and receive queue) each device of a topology is reached on: its `p4:` section.

    p4:
      slow_path: 0                  # where traffic that no entry steers goes
      devices:
        dpu0: {port: 1}             # the Arm cores' representor
        cpu:  {port: 2}             # the host's PF representor
        gpu0: {port: 2, queue: 1}   # the host PF, a receive queue bound to GPU memory

Port numbers are the target's; every mistake is a TopologyError at its `file:line:col`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nicoffload.errors import Mark, TopologyError
from nicoffload.topology import (
    Topology,
    _keys,  # the same unknown-key message as the rest of the file
)
from nicoffload.yamlmarks import MMap, did_you_mean, read_marked

PORT_BITS = 9  # v1model's port width (p4/nicoffload.p4 port_t); a test holds it to the P4Info
QUEUE_BITS = 16
P4_KEYS = ("slow_path", "devices")
PORT_KEYS = ("port", "queue")


@dataclass(frozen=True)
class Port:
    port: int
    queue: int = 0
    mark: Mark | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PortMap:
    """The `p4:` section of one topology file."""

    slow_path: int
    devices: dict[str, Port]
    mark: Mark  # the `devices` mapping, where a missing device would be added

    def for_stage(self, stage: str, device: str) -> Port:
        """The port of the device a stage runs on; TopologyError naming both when there is none."""
        if device in self.devices:
            return self.devices[device]
        have = ", ".join(self.devices) or "none"
        raise TopologyError(
            f"p4: stage '{stage}' runs on device '{device}', which has no port under "
            f"'p4.devices' (ports exist for: {have}); add '{device}: {{port: N}}'",
            self.mark,
        )


def _int(value: object, what: str, bits: int, mark: Mark) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << bits:
        raise TopologyError(
            f"p4: {what} must be an integer from 0 to {(1 << bits) - 1} ({bits} bits), got {value!r}",
            mark,
        )
    return value


def load_ports(topology: Topology) -> PortMap:
    """Read the `p4:` section of the file `topology` came from."""
    if topology.source == "local":
        raise TopologyError(
            "the autodetected local topology has no NIC ports; pass --topology FILE with a "
            "'p4' section (see p4/README.md)"
        )
    doc = read_marked(topology.source, TopologyError)
    if "p4" not in doc:
        raise TopologyError(
            f"topology '{topology.name}' has no 'p4' section: add one that gives each device "
            "its NIC port (see p4/README.md)",
            doc.mark,
        )
    p4 = doc["p4"]
    if not isinstance(p4, MMap):
        raise TopologyError("p4: must be a mapping (slow_path, devices)", doc.mark_of("p4"))
    _keys(p4, P4_KEYS, "p4")
    for key in P4_KEYS:
        if key not in p4:
            raise TopologyError(f"p4: missing '{key}'", p4.mark)
    slow = _int(p4["slow_path"], "'slow_path'", PORT_BITS, p4.mark_of("slow_path"))
    raw = p4["devices"]
    if not isinstance(raw, MMap):
        raise TopologyError("p4: 'devices' must map device ids to ports", p4.mark_of("devices"))
    ids = list(topology.ids)
    devices = {}
    for dev, body in raw.items():
        if dev not in ids:
            raise TopologyError(
                f"p4.devices: unknown device {dev!r}{did_you_mean(str(dev), ids)}",
                raw.key_marks[dev],
            )
        where = f"p4.devices.{dev}"
        if not isinstance(body, MMap) or "port" not in body:
            raise TopologyError(
                f"{where}: must be a mapping like {{port: 1}}", raw.value_marks[dev]
            )
        _keys(body, PORT_KEYS, where)
        port = _int(body["port"], f"{dev}: 'port'", PORT_BITS, body.mark_of("port"))
        queue = _int(body.get("queue", 0), f"{dev}: 'queue'", QUEUE_BITS, body.mark_of("queue"))
        devices[str(dev)] = Port(port, queue, raw.key_marks[dev])
    return PortMap(slow, devices, raw.mark)
