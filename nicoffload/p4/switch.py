"""BMv2's `simple_switch` running a compiled program on pcap files, driven by its runtime CLI.

Port N reads `pN_in.pcap` and writes `pN_out.pcap` in a private folder. The ingress port's input
is a FIFO: the switch blocks on it, so no frame reaches the pipeline before the entries are
installed, and `send()` then writes the frames and closes it. No privileges, no interfaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from nicoffload.errors import SystemFailure
from nicoffload.p4.toolchain import Tools

_PCAP_HEAD = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)  # LINKTYPE_ETHERNET
_RECORD = struct.Struct("<IIII")
_COUNTER = re.compile(r"^(?:RuntimeCmd: )?([\w.]+)\[(\d+)\]= *\((\d+) bytes, (\d+) packets\)", re.M)
_HANDLE = re.compile(r"Entry has been added with handle (\d+)")
_LOG = re.compile(
    r"\[(\d+)\.\d+\] \[cxt \d+\] (?:Table '([\w.]+)': (?:hit|miss)|Action entry is ([\w.]+) - ([\w,]*))"
)
_CLI_ERROR = re.compile(r"^(?:RuntimeCmd: )?(Error|Invalid)[^\n]*", re.M)


class _Exited(SystemFailure):
    """simple_switch exited while it was starting."""


def _die_with_parent() -> None:
    """In the child: SIGTERM it when the process that started it dies (Linux's
    PR_SET_PDEATHSIG), so a test run killed outright leaves no switch behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))


def free_port() -> int:
    """A TCP port nothing listens on now (bound to 0, then released) for the Thrift server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_pcap(blob: bytes) -> list[bytes]:
    """The complete records of a pcap file's bytes (a record still being written is left out)."""
    out, off = [], len(_PCAP_HEAD)
    while off + _RECORD.size <= len(blob):
        incl = _RECORD.unpack_from(blob, off)[2]
        if off + _RECORD.size + incl > len(blob):
            break
        out.append(blob[off + _RECORD.size : off + _RECORD.size + incl])
        off += _RECORD.size + incl
    return out


class PcapSwitch:
    """`with PcapSwitch(tools, json, ports=[0, 1, 2], ingress=0) as sw:` install, send, read."""

    def __init__(
        self, tools: Tools, program: Path, ports: Iterable[int], ingress: int, timeout: float = 20
    ) -> None:
        self.tools, self.program, self.timeout = tools, Path(program).resolve(), timeout
        self.ports, self.ingress = sorted(set(ports) | {ingress}), ingress
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.thrift_port = 0
        self._fifo: int | None = None

    def __enter__(self) -> PcapSwitch:
        for attempt in range(3):
            try:
                self._start()
                return self
            except _Exited:
                self.close()
                if attempt == 2:
                    raise
                # most likely another process took the Thrift port between free_port() and bind
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="nicoffload-bmv2-"))
        for port in self.ports:
            path = self.dir / f"p{port}_in.pcap"
            if port == self.ingress:
                os.mkfifo(path)
            else:
                path.write_bytes(_PCAP_HEAD)
        self.thrift_port = free_port()
        cmd = [self.tools.simple_switch, "--use-files", "0", "--thrift-port", str(self.thrift_port)]
        cmd += ["--notifications-addr", f"ipc://{self.dir}/notifications.ipc"]
        cmd += ["--log-file", "switch", "-L", "debug", "--log-flush"]
        for port in self.ports:
            cmd += ["-i", f"{port}@p{port}"]
        with open(self.dir / "stdout.txt", "wb") as out:
            self.proc = subprocess.Popen(
                [*map(str, cmd), str(self.program)],
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self._fifo = self._open_fifo()
        os.write(self._fifo, _PCAP_HEAD)  # the switch reads it while it adds the ports
        self._until(self._listening, "its Thrift server to listen")

    def _until(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self.proc is not None and self.proc.poll() is not None:
                raise _Exited(
                    f"bmv2: simple_switch exited ({self.proc.returncode}) "
                    f"waiting for {what}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise SystemFailure(f"bmv2: no {what} within {self.timeout} s:\n{self.log()}")
            time.sleep(0.02)

    def _open_fifo(self) -> int:
        fd: list[int] = []

        def opened() -> bool:
            try:  # non-blocking: ENXIO until the switch opens its end
                fd.append(
                    os.open(self.dir / f"p{self.ingress}_in.pcap", os.O_WRONLY | os.O_NONBLOCK)
                )
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                return False
            os.set_blocking(fd[0], True)
            return True

        self._until(opened, "the switch to open its ingress file")
        return fd[0]

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.thrift_port)) == 0

    def cli(self, lines: Iterable[str]) -> str:
        """Run runtime CLI commands; SystemFailure with the CLI's words if any is refused."""
        env = {**os.environ, "PYTHONPATH": str(self.tools.pythonpath)}
        text = "".join(line + "\n" for line in lines)
        cmd = [sys.executable, str(self.tools.cli), "--thrift-port", str(self.thrift_port)]
        run = subprocess.run(cmd, input=text, capture_output=True, text=True, env=env, timeout=60)
        out = run.stdout + run.stderr
        bad = _CLI_ERROR.search(out)
        if run.returncode != 0 or bad:
            raise SystemFailure(f"bmv2 CLI: {bad[0] if bad else out.strip()[-2000:]}\n{text}")
        return out

    def install(self, lines: Iterable[str]) -> list[int]:
        """Run `table_add` / `table_set_default` lines; the handle of each table_add, in order."""
        return [int(h) for h in _HANDLE.findall(self.cli(lines))]

    def counters(self, reads: Iterable[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int]]:
        """(counter, index) -> (packets, bytes), by `counter_read`; a direct counter's index is
        its entry's handle."""
        out = self.cli(f"counter_read {name} {index}" for name, index in reads)
        return {(m[1], int(m[2])): (int(m[4]), int(m[3])) for m in _COUNTER.finditer(out)}

    def send(self, frames: Iterable[bytes]) -> int:
        """Write the frames into the ingress port's input and close it; how many were sent."""
        if self._fifo is None:
            raise SystemFailure("bmv2: frames were sent already")
        count, now = 0, int(time.time())
        try:
            for i, frame in enumerate(frames):
                os.write(self._fifo, _RECORD.pack(now, i, len(frame), len(frame)) + frame)
                count += 1
        finally:
            os.close(self._fifo)
            self._fifo = None
        return count

    def received(self, expect: int) -> dict[int, list[bytes]]:
        """The frames each port sent, once `expect` frames have left the switch in all."""
        got: dict[int, list[bytes]] = {}

        def done() -> bool:
            got.clear()
            for port in self.ports:
                path = self.dir / f"p{port}_out.pcap"
                got[port] = read_pcap(path.read_bytes()) if path.exists() else []
            return sum(map(len, got.values())) >= expect

        self._until(done, f"{expect} frames out")
        return got

    def actions(self, table: str) -> dict[int, tuple[str, tuple[int, ...]]]:
        """Packet number (0 for the first frame sent) -> the action `table` ran on it and its
        arguments, from the switch's debug log: what no output shows, such as forward's queue."""
        out, looked = {}, set()
        for m in _LOG.finditer((self.dir / "switch.txt").read_text(errors="replace")):
            packet = int(m[1])
            if m[2] is not None:
                if m[2] == table:
                    looked.add(packet)
            elif packet in looked:
                looked.discard(packet)
                out[packet] = (m[3], tuple(int(v, 16) for v in m[4].split(",") if v))
        return out

    def log(self) -> str:
        if self.dir is None:
            return ""
        parts = []
        for name in ("stdout.txt", "switch.txt"):
            with contextlib.suppress(OSError):
                parts.append((self.dir / name).read_text(errors="replace")[-4000:])
        return "\n".join(parts)

    def close(self) -> None:
        if self._fifo is not None:
            os.close(self._fifo)
            self._fifo = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
