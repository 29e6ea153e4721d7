"""`nicoffload p4 entries` (a plan as P4Runtime entries) and `nicoffload pcap` (read a capture)."""

from __future__ import annotations

import sys
from enum import IntEnum
from pathlib import Path

import typer

from nicoffload.cli import app, emit_json, handle_errors
from nicoffload.p4 import P4INFO, UDP_PORT

p4_app = typer.Typer(
    help="The NIC data plane (p4/nicoffload.p4): its table entries for a plan.",
    no_args_is_help=True,
)
app.add_typer(p4_app, name="p4")


@p4_app.command()
@handle_errors
def entries(
    plan: Path = typer.Argument(..., help="a plan JSON (`nicoffload plan ... -o PLAN.json`)"),
    topology: Path | None = typer.Option(
        None, "--topology", help="the topology YAML the plan was made on, with a 'p4' section"
    ),
    fmt: str = typer.Option(
        "text",
        "--format",
        help="text (protobuf text format) | json | bmv2 (simple_switch_CLI commands)",
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="write here, not stdout"),
    p4info: Path = typer.Option(P4INFO, "--p4info", help="the P4Info of the program"),
    device_id: int = typer.Option(0, "--device-id", help="the P4Runtime device id"),
    election_id: int = typer.Option(1, "--election-id", help="the controller's election id"),
) -> None:
    """Write the steering entries of a plan as a P4Runtime WriteRequest, checked against the P4Info
    (or, with --format bmv2, as the BMv2 runtime CLI commands that install the same entries)."""
    from nicoffload.errors import PlanError, TopologyError
    from nicoffload.p4.entries import check_devices, render, steering, write_request
    from nicoffload.p4.ids import pipeline_id
    from nicoffload.p4.p4info import P4Info
    from nicoffload.p4.ports import load_ports
    from nicoffload.planner.plan import Plan
    from nicoffload.topology import load_topology

    if fmt not in ("text", "json", "bmv2"):
        raise PlanError(f"--format must be text, json or bmv2, got '{fmt}'")
    if topology is None:  # the autodetected local machine has no NIC ports to steer to
        raise TopologyError(
            "pass --topology T.yaml: the topology the plan was made on, with a 'p4' section "
            "giving each device its NIC port (see p4/README.md)"
        )
    the_plan = Plan.load(plan)
    topo = load_topology(topology)
    check_devices(the_plan, topo.ids, f"topology '{topo.name}'")
    ports = load_ports(topo)
    steer = steering(the_plan, ports)
    info = P4Info.load(p4info)
    request = write_request(
        steer, ports.slow_path, info, device_id=device_id, election_id=election_id
    )
    if fmt == "bmv2":
        from nicoffload.p4 import bmv2

        text = bmv2.render(request, info)
    else:
        text = render(request, fmt)
    pid = pipeline_id(the_plan.pipeline)
    typer.echo(f"pipeline '{the_plan.pipeline}': pipeline_id {pid} ({pid:#010x})", err=True)
    for e in steer:
        typer.echo(
            f"  stage_id {e.stage_id:<5} {e.stage:<12} -> {e.device}: port {e.port}, queue {e.queue}",
            err=True,
        )
    typer.echo(f"  anything else -> slow path, port {ports.slow_path}", err=True)
    if output is not None:
        output.write_text(text)
        typer.echo(f"{len(request.updates)} updates written to {output}", err=True)
    else:
        sys.stdout.write(text)


def _name(enum: type[IntEnum], value: int) -> str:
    try:
        return enum(value).name
    except ValueError:
        return str(value)


@app.command()
@handle_errors
def pcap(
    file: Path = typer.Argument(..., help="a pcap or pcapng capture"),
    port: int = typer.Option(UDP_PORT, "--port", help="the UDP port nicoffload frames use"),
    json_out: bool = typer.Option(False, "--json", help="print the frames as one JSON document"),
) -> None:
    """Decode the nicoffload frames of a capture: UDP datagrams, and TCP streams reassembled."""
    from nicoffload.errors import Mark, UserError

    try:
        from nicoffload.transport.scapy_layer import read_capture

        frames = list(read_capture(file, port))
    except OSError as exc:
        raise UserError(f"cannot read the capture: {exc}", Mark(str(file), 1, 1)) from None
    except Exception as exc:  # scapy says "not a supported capture file" with its own types
        if type(exc).__module__.startswith("scapy"):
            raise UserError(f"not a capture: {exc}", Mark(str(file), 1, 1)) from None
        raise
    bad = sum(f.error is not None for f in frames)
    if json_out:
        emit_json({"file": str(file), "frames": [f.to_json() for f in frames], "malformed": bad})
        return
    from nicoffload.transport.frame import DType, Kind

    for f in frames:
        h = f.fields
        if not h:
            typer.echo(f"#{f.index} {f.transport} {f.src} -> {f.dst}: {f.error}")
            continue
        kind, dtype = _name(Kind, h["kind"]), _name(DType, h["dtype"])
        shape = [h[f"shape{i}"] for i in range(min(h["ndim"], 4))]
        typer.echo(
            f"#{f.index} {f.transport} {f.src} -> {f.dst} {kind} pipeline={h['pipeline_id']} "
            f"stage={h['stage_id']} slot={h['slot']} request={h['request_id']} "
            f"batch={h['batch_size']} {dtype}{shape} payload={h['payload_len']} "
            + ("ok" if f.error is None else f"MALFORMED: {f.error}")
        )
    typer.echo(f"{len(frames)} nicoffload frames, {bad} malformed", err=True)
