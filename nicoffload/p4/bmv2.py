"""A checked P4Runtime WriteRequest as BMv2 runtime CLI commands (`simple_switch_CLI`, Thrift).

BMv2's `simple_switch` built without gRPC has no P4Runtime server; its CLI takes `table_add` and
`table_set_default` lines that name tables, actions and values instead of P4Info ids. This
translates the request `nicoffload p4 entries` writes, id for id, through the same P4Info.
"""

from __future__ import annotations

from typing import Any

from nicoffload.p4._proto import proto
from nicoffload.p4.p4info import P4Info, P4InfoMismatch, decode


def _args(pairs: list[tuple[Any, bytes]], what: str) -> list[str]:
    """Decimal values in P4Info order; `pairs` are (P4Info member, the request's byte string)."""
    return [str(decode(blob, spec.bitwidth, f"{what} '{spec.name}'")) for spec, blob in pairs]


def commands(request: Any, p4info: P4Info) -> list[str]:
    """One CLI line per update: INSERT -> table_add, MODIFY of a default entry ->
    table_set_default. Other updates need BMv2's entry handles, which only the switch knows."""
    p4info.check(request)
    pb = proto().p4runtime_pb2
    lines = []
    for update in request.updates:
        te = update.entity.table_entry
        table = p4info.tables[te.table_id]
        call = te.action.action
        action = p4info.actions[call.action_id]
        given = {p.param_id: p.value for p in call.params}
        params = _args([(p, given[p.id]) for p in action.params], "param")
        head = [table.preamble.name, action.preamble.name]
        if update.type == pb.Update.MODIFY and te.is_default_action:
            lines.append(" ".join(["table_set_default", *head, *params]))
        elif update.type == pb.Update.INSERT and not te.is_default_action:
            match = {m.field_id: m.exact.value for m in te.match}
            keys = _args([(f, match[f.id]) for f in table.match_fields], "field")
            lines.append(" ".join(["table_add", *head, *keys, "=>", *params]))
        else:
            kind = pb.Update.Type.Name(update.type)
            raise P4InfoMismatch(
                f"bmv2: a {kind} of a {'default' if te.is_default_action else 'table'} entry "
                "has no CLI form without the switch's entry handle (only INSERT and a MODIFY of "
                "the default entry are translated)"
            )
    return lines


def render(request: Any, p4info: P4Info) -> str:
    """The commands as the text `simple_switch_CLI` reads on its standard input."""
    return "".join(line + "\n" for line in commands(request, p4info))
