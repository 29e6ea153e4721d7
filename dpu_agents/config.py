"""The agent's configuration: defaults, then a TOML file (`--config`), then command-line flags.

Every key of `agent.example.toml` is a field of AgentConfig; an unknown key or a wrong type is a
UserError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nicoffload.agent.protocol import DEFAULT_MAX_REQUEST_BYTES
from nicoffload.errors import Mark, UserError
from nicoffload.yamlmarks import did_you_mean

MAX_DEDUP_WINDOW = 1 << 24
WORKER_PROCESSES = ("auto", "on", "off")
PROCESSES_FROM = 4  # cores: below, `auto` runs the kernels in threads


@dataclass(frozen=True)
class AgentConfig:
    listen: str = "127.0.0.1:7070"  # loopback unless told otherwise
    token_file: str = ""
    cores: int = 0  # 0: every core this process may run on
    # The kernels in one worker process per core (on), or in threads of the agent (off); auto:
    # processes from PROCESSES_FROM cores (threads share one GIL: bench/RESULTS.md).
    worker_processes: str = "auto"
    worker_timeout_s: float = 120.0  # a worker process silent this long on rows is killed
    metrics: str = ""  # HOST:PORT of the Prometheus endpoint; empty: none
    metrics_remote: bool = False  # the operator's opt-in to a metrics address off loopback
    metrics_token_file: str = ""  # scrapes must send `Authorization: Bearer <its content>`
    metrics_max_connections: int = 4  # more: the oldest is closed for the newest
    metrics_timeout_s: float = 5.0  # a metrics connection is closed this long after accept
    max_connections: int = 64  # authenticated connections (sessions)
    max_handshakes: int = 32  # connections not yet authenticated; more: the oldest is dropped
    max_handshakes_per_address: int = 8  # of those, from one address
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    window: int = 256  # REQUEST credits per session (bounds the agent's memory per client)
    handshake_timeout_s: float = 3.0  # authenticate within this or be dropped
    idle_timeout_s: float = 60.0  # an authenticated client silent this long is dropped
    io_timeout_s: float = 30.0  # a peer silent this long in the middle of a frame is dropped
    forward_timeout_s: float = 60.0  # the next placement holds every slot this long: fail
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight work gets this long to finish
    dedup_window: int = 1 << 20  # ids below a session's newest that are told apart (1 bit each)
    forward_allow: tuple[str, ...] = ()  # CIDRs a LOAD may forward to, besides the client's own
    tokenizer_dir: str = ""  # where a LOAD's tokenizer ids are looked up (`<id>.json`)
    auth_failures: int = 10  # wrong tokens from one address within auth_failures_window_s...
    auth_failures_window_s: float = 60.0
    auth_block_s: float = 60.0  # ...and its new connections are dropped this long
    # Memory budget (dpu_agents/budget.py): over it a client waits (its socket is not read);
    # one request larger than its pool fails as too_large.
    queued_bytes: int = 1 << 30  # request payloads received and not yet forwarded, all clients
    queued_bytes_per_client: int = 256 << 20
    decode_bytes: int = 2 << 30  # images being decoded (sized from their headers), all clients
    decode_bytes_per_client: int = 512 << 20
    batch_bytes: int = 2 << 30  # the batch slots of every loaded stage
    # The worker processes' arenas (shared memory the rows' inputs, and their outputs of varying
    # shape, cross in): all of them, one at most, and the size one keeps between chunks.
    arena_bytes: int = 1 << 30
    max_arena_bytes: int = 256 << 20  # a row needing more runs on the host (slot_overflow)
    arena_keep_bytes: int = 16 << 20  # a larger arena is given back after its chunk
    payload_timeout_s: float = 20.0  # a request's whole payload must arrive within this
    # What a LOAD may ask for; above it the LOAD is refused, naming the key.
    max_pixels: int = 40_000_000  # a decode_image node's max_pixels
    max_batch: int = 1024  # batch_max_size
    max_value_bytes: int = 64 << 20  # one item's value of any node of the stage (static shapes)
    max_slot_bytes: int = 256 << 20  # one batch slot: batch size x the bytes forwarded per item
    log_level: str = "info"

    def processes(self, cores: int) -> bool:
        """Whether an agent of `cores` cores runs its kernels in worker processes."""
        if self.worker_processes == "auto":
            return cores >= PROCESSES_FROM
        return self.worker_processes == "on"

    def replace(self, **changes: Any) -> AgentConfig:
        """A copy with the given (non-None) fields changed and checked."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return _checked(dataclasses.replace(self, **changes), Mark("<command line>", 1, 1))


_FIELDS = {f.name: f for f in dataclasses.fields(AgentConfig)}
_COUNTS = [n for n, f in _FIELDS.items() if f.type == "int" and n != "cores"]
_TYPES: dict[str, Any] = {
    "int": int,
    "float": (int, float),
    "str": str,
    "bool": bool,
    "tuple[str, ...]": list,
}


def _checked(cfg: AgentConfig, mark: Mark) -> AgentConfig:
    for name in _COUNTS:
        if getattr(cfg, name) < 1:
            raise UserError(f"'{name}' must be at least 1, got {getattr(cfg, name)}", mark)
    if cfg.cores < 0:
        raise UserError(f"'cores' must be >= 0, got {cfg.cores}", mark)
    if cfg.worker_processes not in WORKER_PROCESSES:
        raise UserError(
            f"'worker_processes' must be one of {', '.join(WORKER_PROCESSES)}, "
            f"got {cfg.worker_processes!r}",
            mark,
        )
    if not cfg.arena_keep_bytes <= cfg.max_arena_bytes <= cfg.arena_bytes:
        raise UserError(
            "the arena sizes must be arena_keep_bytes <= max_arena_bytes <= arena_bytes, got "
            f"{cfg.arena_keep_bytes}, {cfg.max_arena_bytes}, {cfg.arena_bytes}",
            mark,
        )
    for name in _FIELDS:
        if name.endswith("_s") and getattr(cfg, name) <= 0:
            raise UserError(f"'{name}' must be positive, got {getattr(cfg, name)}", mark)
    for name in ("listen", "metrics"):
        value = getattr(cfg, name)
        if value:
            split_hostport(value, name, mark)
    if cfg.dedup_window > MAX_DEDUP_WINDOW:  # one bit per id, per session
        raise UserError(
            f"'dedup_window' must be at most {MAX_DEDUP_WINDOW} (2 MiB a session), "
            f"got {cfg.dedup_window}",
            mark,
        )
    if cfg.tokenizer_dir and not Path(cfg.tokenizer_dir).is_dir():
        raise UserError(f"'tokenizer_dir' {cfg.tokenizer_dir!r} is not a directory", mark)
    for cidr in cfg.forward_allow:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise UserError(
                f"'forward_allow': {cidr!r} is not an address or network (e.g. '10.0.0.0/24')",
                mark,
            ) from None
    if cfg.metrics and not cfg.metrics_remote and not is_loopback(split_hostport(cfg.metrics)[0]):
        raise UserError(
            f"'metrics' {cfg.metrics!r} is not a loopback address: the endpoint is unauthenticated "
            "unless 'metrics_token_file' is set; set 'metrics_remote = true' to serve it there",
            mark,
        )
    return cfg


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or 'localhost'; a name or a wildcard (0.0.0.0, ::) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address `host` spells (an IPv4-mapped IPv6 one as IPv4); None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def may_forward(target: str, client: str, here: str, allow: tuple[str, ...]) -> bool:
    """Whether a LOAD from `client` (an IP address) may send its outputs to `target` (its
    forward_to): over tcp or rdma, to the client's own address or one in `allow` (CIDRs); over
    shm (a segment of this machine, whose address is `here`), for a client on this machine. A
    name is never resolved: the agent connects only where the operator said it may."""
    peer = ip_of(client)
    if peer is None:
        return False
    if target.startswith("shm://"):
        return peer.is_loopback or peer == ip_of(here)
    try:
        ip = ip_of(urlsplit(target).hostname or "")
    except ValueError:
        return False
    if ip is None:
        return False
    return ip == peer or any(ip in ipaddress.ip_network(n, strict=False) for n in allow)


def split_hostport(text: str, what: str = "address", mark: Mark | None = None) -> tuple[str, int]:
    """('127.0.0.1', 7070) from '127.0.0.1:7070' ('[::1]:7070' for IPv6)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UserError(f"'{what}' must be HOST:PORT, got {text!r}", mark)
    return host, int(port)


def load_config(path: str | Path | None) -> AgentConfig:
    """The defaults overridden by the TOML file at `path` (None: the defaults)."""
    if path is None:
        return AgentConfig()
    mark = Mark(str(path), 1, 1)
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read the config file: {exc.strerror}", mark) from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"not valid TOML: {exc}", mark) from None
    values = doc.get("agent", doc)  # keys at the top level or under [agent]
    for key, value in values.items():
        field = _FIELDS.get(key)
        if field is None:
            raise UserError(f"unknown key '{key}'{did_you_mean(key, list(_FIELDS))}", mark)
        want = _TYPES[str(field.type)]
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise UserError(f"'{key}' must be of type {field.type}, got {value!r}", mark)
        if want is list:
            if not all(isinstance(v, str) for v in value):
                raise UserError(f"'{key}' must be a list of strings, got {value!r}", mark)
            values[key] = tuple(value)
    return _checked(AgentConfig(**values), mark)
