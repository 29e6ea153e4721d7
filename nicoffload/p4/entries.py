"""A Plan becomes the steering table's entries, then a P4Runtime WriteRequest checked against
the P4Info: one `forward` entry per stage (and one for the egress device), plus the table's
default action, `to_slow_path`, pointed at the topology's slow-path port.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from nicoffload.errors import TopologyError
from nicoffload.p4._proto import proto
from nicoffload.p4.ids import pipeline_id, stage_ids
from nicoffload.p4.p4info import P4Info, encode
from nicoffload.p4.ports import PortMap
from nicoffload.planner.plan import Plan

TABLE = "NicoffloadIngress.steer"
FORWARD = "NicoffloadIngress.forward"
SLOW_PATH = "NicoffloadIngress.to_slow_path"


@dataclass(frozen=True)
class SteerEntry:
    """Frames of (pipeline_id, stage_id) go to `port`, receive queue `queue`."""

    pipeline_id: int
    stage_id: int
    stage: str
    device: str
    port: int
    queue: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def steering(plan: Plan, ports: PortMap) -> tuple[SteerEntry, ...]:
    """One entry per stage of the plan and one for its egress; TopologyError for a stage whose
    device has no port."""
    pid = pipeline_id(plan.pipeline)
    ids = stage_ids(plan)
    where = [(s.name, s.device) for s in plan.stages]
    if plan.egress is not None:
        where.append(("egress", plan.egress))
    out = []
    for stage, device in where:
        port = ports.for_stage(stage, device)
        out.append(SteerEntry(pid, ids[stage], stage, device, port.port, port.queue))
    return tuple(out)


def check_devices(plan: Plan, device_ids: tuple[str, ...], source: str) -> None:
    """A plan made on another topology names devices this one lacks: say so, not 'no port'."""
    used = [s.device for s in plan.stages] + ([plan.egress] if plan.egress else [])
    for dev in used:
        if dev not in device_ids:
            raise TopologyError(
                f"the plan (made on topology '{plan.topology}') places work on '{dev}', which "
                f"{source} does not have (devices: {', '.join(device_ids)}); pass the topology "
                "the plan was made on"
            )


def write_request(
    entries: tuple[SteerEntry, ...],
    slow_path_port: int,
    p4info: P4Info,
    *,
    device_id: int = 0,
    election_id: int = 1,
) -> Any:
    """The p4.v1.WriteRequest installing `entries` and the slow-path default; checked."""
    pb = proto().p4runtime_pb2
    table = p4info.table(TABLE)
    forward, slow = p4info.action(FORWARD), p4info.action(SLOW_PATH)
    keys = [p4info.field(table, name) for name in ("pipeline_id", "stage_id")]
    fparams = [p4info.param(forward, name) for name in ("port", "queue")]
    request = pb.WriteRequest(device_id=device_id)
    request.election_id.low = election_id
    for e in entries:
        update = request.updates.add(type=pb.Update.INSERT)
        te = update.entity.table_entry
        te.table_id = table.preamble.id
        for f, value in zip(keys, (e.pipeline_id, e.stage_id), strict=True):
            te.match.add(field_id=f.id).exact.value = encode(value, f.bitwidth)
        te.action.action.action_id = forward.preamble.id
        for p, value in zip(fparams, (e.port, e.queue), strict=True):
            te.action.action.params.add(param_id=p.id, value=encode(value, p.bitwidth))
    update = request.updates.add(type=pb.Update.MODIFY)  # a table's default entry is modified
    te = update.entity.table_entry
    te.table_id, te.is_default_action = table.preamble.id, True
    te.action.action.action_id = slow.preamble.id
    sp = p4info.param(slow, "port")
    te.action.action.params.add(param_id=sp.id, value=encode(slow_path_port, sp.bitwidth))
    p4info.check(request)
    return request


def render(request: Any, fmt: str) -> str:
    """The WriteRequest as protobuf text format or as P4Runtime JSON (proto3 JSON mapping)."""
    pb = proto()
    if fmt == "json":
        return pb.json_format.MessageToJson(request, indent=2) + "\n"
    return pb.text_format.MessageToString(request)
