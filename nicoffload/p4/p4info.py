"""A P4Info, indexed by name and id, and the check of a WriteRequest against it.

The check is what a P4Runtime server would refuse at Write time, done before anything is sent:
ids that exist, every exact match field present once, byte strings that fit their bit widths,
actions the table allows in that scope, every parameter present once and fitting; and, as the
spec asks of every encoder, byte strings in canonical (shortest) form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nicoffload.errors import Mark, SystemFailure, UserError
from nicoffload.p4._proto import proto


class P4InfoMismatch(SystemFailure):
    """Entries that the P4Info (the program on the NIC) would refuse."""


def encode(value: int, bits: int) -> bytes:
    """The canonical P4Runtime byte string of `value`: big-endian, shortest, 0 as one byte."""
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{value} does not fit in {bits} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode(blob: bytes, bits: int, what: str) -> int:
    """The value of a received byte string, by the spec's receiver rule ("Bytestrings"): any
    length, leading zero bytes allowed, but not empty and no wider than `bits` once they go."""
    if not blob:
        raise P4InfoMismatch(f"{what}: an empty byte string")
    value = int.from_bytes(blob, "big")
    if value >= 1 << bits:
        raise P4InfoMismatch(f"{what}: {value} does not fit in {bits} bits")
    return value


def _decode_canonical(blob: bytes, bits: int, what: str) -> int:
    """decode, and the encoder's rule too: the shortest string (read-write symmetry)."""
    value = decode(blob, bits, what)
    if blob != encode(value, bits):
        raise P4InfoMismatch(f"{what}: {blob!r} is not a canonical byte string")
    return value


class P4Info:
    """Tables and actions of one P4Info message, by name (full or alias) and by id."""

    def __init__(self, message: Any, source: str = "<p4info>") -> None:
        self.message, self.source = message, source
        self.tables = {t.preamble.id: t for t in message.tables}
        self.actions = {a.preamble.id: a for a in message.actions}

    @classmethod
    def load(cls, path: str | Path) -> P4Info:
        pb = proto()
        try:
            text = Path(path).read_text()
            message = pb.text_format.Parse(text, pb.p4info_pb2.P4Info())
        except (OSError, pb.text_format.ParseError) as exc:
            raise UserError(f"cannot read the P4Info: {exc}", Mark(str(path), 1, 1)) from None
        return cls(message, str(path))

    def canonical(self) -> Any:
        """A copy of the message with its byte strings in canonical form.

        p4c writes `initial_default_action` arguments padded to their width (`\\x00\\x00` for
        a 0 of bit<9>): valid by the receiver rule, but not the canonical `\\x00`.
        """
        out = type(self.message)()
        out.CopyFrom(self.message)
        for table in out.tables:
            default = table.initial_default_action
            if not default.action_id:
                continue
            action = self.actions.get(default.action_id)
            if action is None:
                raise P4InfoMismatch(
                    f"{self.source}: table '{table.preamble.name}': initial default action id "
                    f"{default.action_id} is not an action"
                )
            widths = {p.id: p.bitwidth for p in action.params}
            for arg in default.arguments:
                what = (
                    f"{self.source}: '{table.preamble.name}' initial default param {arg.param_id}"
                )
                if arg.param_id not in widths:
                    raise P4InfoMismatch(f"{what}: '{action.preamble.name}' has no such param")
                bits = widths[arg.param_id]
                arg.value = encode(decode(arg.value, bits, what), bits)
        return out

    def _find(self, kind: str, items: dict[int, Any], name: str) -> Any:
        for item in items.values():
            if name in (item.preamble.name, item.preamble.alias):
                return item
        have = ", ".join(i.preamble.name for i in items.values()) or "none"
        raise P4InfoMismatch(f"{self.source}: no {kind} '{name}' (there are: {have})")

    def table(self, name: str) -> Any:
        return self._find("table", self.tables, name)

    def action(self, name: str) -> Any:
        return self._find("action", self.actions, name)

    def field(self, table: Any, name: str) -> Any:
        return self._member(table, table.match_fields, "match field", name)

    def param(self, action: Any, name: str) -> Any:
        return self._member(action, action.params, "param", name)

    def _member(self, owner: Any, items: Any, kind: str, name: str) -> Any:
        for item in items:
            if item.name == name:
                return item
        have = ", ".join(i.name for i in items) or "none"
        raise P4InfoMismatch(
            f"{self.source}: '{owner.preamble.name}' has no {kind} '{name}' (there are: {have})"
        )

    def check_entry(self, entry: Any) -> None:
        """Raise P4InfoMismatch for anything in `entry` (a p4.v1.TableEntry) the target refuses."""
        table = self.tables.get(entry.table_id)
        if table is None:
            raise P4InfoMismatch(f"table entry: unknown table id {entry.table_id}")
        where = f"table '{table.preamble.name}'"
        fields = {f.id: f for f in table.match_fields}
        seen = set()
        for match in entry.match:
            f = fields.get(match.field_id)
            if f is None or match.field_id in seen:
                raise P4InfoMismatch(
                    f"{where}: match field id {match.field_id} unknown or repeated"
                )
            seen.add(match.field_id)
            kind = match.WhichOneof("field_match_type")
            want = proto().p4info_pb2.MatchField.MatchType.Name(f.match_type).lower()
            if kind != want:
                raise P4InfoMismatch(f"{where}: field '{f.name}' is {want}, the entry has {kind}")
            _decode_canonical(getattr(match, kind).value, f.bitwidth, f"{where}: field '{f.name}'")
        exact = proto().p4info_pb2.MatchField.EXACT
        missing = [f.name for f in fields.values() if f.match_type == exact and f.id not in seen]
        if entry.is_default_action and entry.match:
            raise P4InfoMismatch(f"{where}: a default entry has no match fields")
        if missing and not entry.is_default_action:
            raise P4InfoMismatch(f"{where}: exact fields {missing} missing")
        if entry.priority and all(f.match_type == exact for f in fields.values()):
            raise P4InfoMismatch(f"{where}: an exact-match table takes no priority")
        self._check_action(table, entry)

    def _check_action(self, table: Any, entry: Any) -> None:
        where = f"table '{table.preamble.name}'"
        if entry.action.WhichOneof("type") != "action":
            raise P4InfoMismatch(f"{where}: the entry has no direct action")
        call = entry.action.action
        refs = {r.id: r for r in table.action_refs}
        action = self.actions.get(call.action_id)
        if action is None or call.action_id not in refs:
            raise P4InfoMismatch(f"{where}: action id {call.action_id} is not one of its actions")
        name = action.preamble.name
        scope = proto().p4info_pb2.ActionRef
        forbidden = scope.TABLE_ONLY if entry.is_default_action else scope.DEFAULT_ONLY
        if refs[call.action_id].scope == forbidden:
            role = "default" if entry.is_default_action else "table entry"
            raise P4InfoMismatch(f"{where}: action '{name}' cannot be a {role} action")
        params = {p.id: p for p in action.params}
        got = [p.param_id for p in call.params]
        if sorted(got) != sorted(params):
            raise P4InfoMismatch(
                f"{where}: action '{name}' takes params {sorted(params)}, the entry gives {got}"
            )
        for p in call.params:
            spec = params[p.param_id]
            what = f"{where}: action '{name}' param '{spec.name}'"
            _decode_canonical(p.value, spec.bitwidth, what)

    def check(self, request: Any) -> None:
        """Check every table entry of a p4.v1.WriteRequest."""
        for update in request.updates:
            if update.entity.WhichOneof("entity") != "table_entry":
                raise P4InfoMismatch("only table entries are written")
            self.check_entry(update.entity.table_entry)
