"""Boot a guest kernel with Soft-RoCE (rdma_rxe) under QEMU and run a command inside it on real
verbs: this machine's root shared read-only over 9p, the repository read-write, an `out` folder
that carries the log and exit status back (QEMU's own exit status does not carry the guest's).

    python tests/rdma/vm.py                     # the RDMA tests (tests/rdma), inside the guest
    python tests/rdma/vm.py [--] COMMAND...     # runs in the repository, inside the guest

The kernel (Debian's linux-image-amd64, extracted, never installed), its modules and the busybox
initramfs are cached in ~/.cache/nicoffload/rdma-vm/. As root, missing apt packages are installed.
/dev/kvm on this machine kind is nested PVM, where a stock kernel fails (cmpxchg16b), so QEMU
runs in software (TCG): about 5 s to a ready guest.
"""

from __future__ import annotations

import argparse
import compileall
import lzma
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

CACHE = Path(os.environ.get("NICOFFLOAD_RDMA_VM_CACHE", "~/.cache/nicoffload/rdma-vm")).expanduser()
REPO = Path(__file__).resolve().parents[2]
APT = [
    "qemu-system-x86", "busybox-static", "rdma-core", "ibverbs-utils", "ibverbs-providers",
    "python3-pyverbs", "iproute2",
]  # fmt: skip
MODULES = ["virtio_pci", "9pnet_virtio", "9p", "crc32_generic", "ib_uverbs", "rdma_rxe", "dummy"]
# rdma_rxe asks the crypto API for "crc32" (its ICRC): without a provider, adding a link is ENOENT
# Two vCPUs (multi-threaded TCG): the split test's two processes (the test and its agent) each
# spend ~30 s on numba's first use and do it side by side; on this 2-core machine, idle, the
# step took 99-121 s with two against 112-128 s with one (slower with two under other load).
SMP = int(os.environ.get("NICOFFLOAD_RDMA_VM_SMP", "2"))
THREAD = "multi" if SMP > 1 else "single"
QBOOT = Path("/usr/share/qemu/qboot.rom")
GUEST_PYVERBS = "/tmp/pyverbs-path"  # a folder holding only the pyverbs package (a link)
# What make test-rdma runs. No entry-point plugins: hypothesis alone costs ~25 s to import under
# TCG (at the terminal summary), pytest-benchmark and anyio ~3 s each; tests/rdma uses none.
PYTEST = (
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 .venv/bin/python -m pytest -q -p no:cacheprovider -rs"
    " --durations=8 tests/rdma"
)

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /lib/modules/$m || echo "insmod $m failed"; done
o=trans=virtio,version=9p2000.L,msize=524288,cache=loose
mkdir -p /host && mount -t 9p -o $o,ro host /host || echo "no host share"
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mount -t tmpfs tmp /host/tmp; mkdir -p /host/tmp/out /host/dev/shm
# the repository last: a clone under /tmp (CI's) would be hidden by the tmpfs above
mkdir -p /host@REPO@ 2>/dev/null; mount -t 9p -o $o work /host@REPO@
mount -t tmpfs shm /host/dev/shm; mount -t 9p -o trans=virtio,version=9p2000.L out /host/tmp/out
mkdir -p /host/tmp/numba; mount -t 9p -o trans=virtio,version=9p2000.L numba /host/tmp/numba
ip link set lo up; ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy
ip link set dummy0 up
ip addr add 10.77.0.1/24 dev dummy0
chroot /host rdma link add rxe0 type rxe netdev dummy0 || echo "rdma link add failed"
echo "guest ready $(cut -d' ' -f1 /proc/uptime) s"
chroot /host /bin/sh -c 'cd @REPO@ && . /tmp/out/env && sh /tmp/out/run.sh' \
  > /host/tmp/out/log 2>&1
echo $? > /host/tmp/out/rc.tmp && mv /host/tmp/out/rc.tmp /host/tmp/out/rc
sync; poweroff -f
"""


def log(msg: str) -> None:
    print(f"rdma-vm: {msg}", file=sys.stderr, flush=True)


def ensure_packages() -> None:
    missing = [p for p in APT if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit(f"rdma-vm: needs the apt packages {' '.join(missing)} (run as root to install)")
    log(f"installing {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )


def _download(package: str, into: Path) -> Path:
    subprocess.run(["apt-get", "download", package], cwd=into, check=True, capture_output=True)
    return max(into.glob(f"{package}_*.deb"), key=lambda p: p.stat().st_mtime)


def ensure_kernel() -> tuple[Path, Path]:
    """vmlinux (uncompressed ELF, PVH entry) and its modules folder, downloaded once."""
    done = CACHE / "kernel.ready"
    if done.exists():
        release = done.read_text().strip()
        return CACHE / "vmlinux", CACHE / "root" / "lib" / "modules" / release
    CACHE.mkdir(parents=True, exist_ok=True)
    log("fetching Debian's linux-image-amd64 (not installed: extracted into the cache)")
    meta = _download("linux-image-amd64", CACHE)
    depends = subprocess.run(
        ["dpkg-deb", "-f", str(meta), "Depends"], capture_output=True, text=True, check=True
    ).stdout
    image = re.search(r"linux-image-[0-9][^ ,]*", depends)
    assert image, depends
    deb = _download(image.group(0), CACHE)
    shutil.rmtree(CACHE / "root", ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(CACHE / "root")], check=True)
    vmlinuz = next((CACHE / "root" / "boot").glob("vmlinuz-*"))
    release = vmlinuz.name.removeprefix("vmlinuz-")
    (CACHE / "vmlinux").write_bytes(extract_vmlinux(vmlinuz.read_bytes()))
    for p in (meta, deb):
        p.unlink()
    done.write_text(release)
    return CACHE / "vmlinux", CACHE / "root" / "lib" / "modules" / release


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF inside a bzImage (xz-compressed, as Debian builds it): what scripts/extract-vmlinux
    does, for the PVH entry point QEMU boots directly."""
    at = 0
    while (at := bzimage.find(b"\xfd7zXZ\x00", at)) >= 0:
        try:
            out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[at:])
        except lzma.LZMAError:
            at += 1
            continue
        if out[:4] == b"\x7fELF":
            return out
        at += 1
    raise SystemExit("rdma-vm: no xz-compressed ELF found in the kernel image")


def module_order(moddir: Path, wanted: list[str]) -> list[str]:
    """Paths (relative to moddir) of `wanted` and their dependencies, dependencies first; read
    from each module's `depends=` modinfo (the package ships no modules.dep: depmod makes it)."""
    by_name = {
        p.name.split(".ko")[0].replace("-", "_"): p for p in moddir.rglob("*.ko*") if p.is_file()
    }
    order: list[str] = []

    def visit(name: str) -> None:
        path = by_name[name]
        data = path.read_bytes()
        if path.name.endswith(".xz"):
            data = lzma.decompress(data)
        found = re.search(rb"\0depends=([^\0]*)\0", data)
        for dep in found.group(1).decode().split(",") if found else []:
            if dep:
                visit(dep.replace("-", "_"))
        rel = str(path.relative_to(moddir))
        if rel not in order:
            order.append(rel)

    for name in wanted:
        visit(name)
    return order


def ensure_initramfs(moddir: Path) -> Path:
    """A busybox initramfs (newc cpio) holding the modules and the init script."""
    init = INIT.replace("@REPO@", str(REPO))
    key = f"{moddir.name}-{zlib.crc32((init + repr(MODULES)).encode()):08x}"
    path = CACHE / f"initramfs-{key}.cpio"
    if path.exists():
        return path
    for old in CACHE.glob("initramfs-*.cpio"):  # built for another kernel or init script
        old.unlink()
    files: list[tuple[str, int, bytes]] = []  # (path, mode, data); mode 0o040755 for a dir
    for d in ("bin", "dev", "proc", "sys", "lib", "lib/modules", "host", "tmp"):
        files.append((d, 0o040755, b""))
    files.append(("bin/busybox", 0o100755, Path("/bin/busybox").read_bytes()))
    files.append(("init", 0o100755, init.encode()))
    names = []
    for mod in module_order(moddir, MODULES):
        name = Path(mod).name
        data = (moddir / mod).read_bytes()
        if name.endswith(".xz"):
            data, name = lzma.decompress(data), name.removesuffix(".xz")
        files.append((f"lib/modules/{name}", 0o100644, data))
        names.append(name)
    files.append(("modules.order", 0o100644, "\n".join(names).encode() + b"\n"))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(cpio(files))
    tmp.rename(path)
    return path


def cpio(files: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray()

    def entry(ino: int, name: str, mode: int, data: bytes) -> None:
        raw = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0]
        out.extend(b"070701" + b"".join(b"%08X" % f for f in fields) + raw)
        out.extend(b"\0" * (-len(out) % 4) + data)
        out.extend(b"\0" * (-len(out) % 4))

    for i, (name, mode, data) in enumerate(files, 1):
        entry(i, name, mode, data)
    entry(0, "TRAILER!!!", 0, b"")
    return bytes(out)


def compile_bytecode() -> None:
    """The repository's .pyc, written here (ignored by git) in a second: the guest only reads them
    (PYTHONDONTWRITEBYTECODE), and compiling every module from source costs each of its Python
    processes seconds under TCG. A fresh clone has none."""
    started = time.monotonic()
    for package in ("nicoffload", "dpu_agents"):
        compileall.compile_dir(REPO / package, quiet=1)
    log(f"bytecode for the guest ready in {time.monotonic() - started:.1f} s")


def warm_numba() -> Path:
    """The guest's numba cache, filled here first (see warm_numba.py): seconds when warm."""
    numba = CACHE / "numba"
    numba.mkdir(exist_ok=True)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba), "NUMBA_CPU_NAME": "generic"}
    started = time.monotonic()
    warm = [sys.executable, str(REPO / "tests" / "rdma" / "warm_numba.py")]
    subprocess.run(warm, cwd=REPO, env=env, check=True, stdin=subprocess.DEVNULL)
    log(f"numba kernels for the guest ready in {time.monotonic() - started:.1f} s")
    return numba


def run(command: str, *, timeout: float = 240.0, env: dict[str, str] | None = None) -> int:
    """Run `command` (sh) in the repository inside a fresh guest; its log on stdout; its status."""
    ensure_packages()
    vmlinux, moddir = ensure_kernel()
    initramfs = ensure_initramfs(moddir)
    for old in CACHE.glob("run-*"):  # left by a run that was killed, an hour ago or more
        if time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    out = Path(tempfile.mkdtemp(prefix="run-", dir=CACHE))
    guest_env = {
        "PYTHONPATH": GUEST_PYVERBS,
        "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "NICOFFLOAD_IN_RDMA_VM": "1",
        # The guest's CPU is not this machine's: its numba code is cached apart, outside the
        # repository, and kept between runs (compiling under TCG takes minutes; loading, not).
        "NUMBA_CACHE_DIR": "/tmp/numba",
        "NUMBA_CPU_NAME": "generic",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        **(env or {}),
    }
    (out / "env").write_text(
        "".join(f"export {k}={shlex.quote(v)}\n" for k, v in guest_env.items())
        + f"mkdir -p {GUEST_PYVERBS} && ln -s /usr/lib/python3/dist-packages/pyverbs "
        f"{GUEST_PYVERBS}/pyverbs\n"
    )
    (out / "run.sh").write_text(command + "\n")
    serial = out / "serial.log"
    compile_bytecode()
    numba = warm_numba()
    share = "local,security_model=none,id="
    qemu = [
        "qemu-system-x86_64", "-accel", f"tcg,thread={THREAD}", "-M", "pc", "-cpu", "max",
        "-smp", str(SMP),
        "-m", "1024", "-bios", str(QBOOT), "-kernel", str(vmlinux), "-initrd", str(initramfs),
        "-append", "console=ttyS0 quiet panic=-1 random.trust_cpu=on",
        "-display", "none", "-no-reboot", "-serial", f"file:{serial}", "-net", "none",
        "-fsdev", f"{share}host,path=/,readonly=on,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=host,mount_tag=host",
        "-fsdev", f"{share}work,path={REPO}",
        "-device", "virtio-9p-pci,fsdev=work,mount_tag=work",
        "-fsdev", f"{share}numba,path={numba}",
        "-device", "virtio-9p-pci,fsdev=numba,mount_tag=numba",
        "-fsdev", f"{share}out,path={out}",
        "-device", "virtio-9p-pci,fsdev=out,mount_tag=out",
    ]  # fmt: skip
    started = time.monotonic()
    try:
        subprocess.run(qemu, stdin=subprocess.DEVNULL, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        log(f"the guest did not finish within {timeout} s")
    took = time.monotonic() - started
    guest_log = out / "log"
    if guest_log.exists():
        sys.stdout.write(guest_log.read_text(errors="replace"))
    rc_file = out / "rc"
    if not rc_file.exists():
        log("no exit status from the guest; its console:")
        sys.stderr.write(serial.read_text(errors="replace")[-4000:] if serial.exists() else "")
        return 1
    rc = int(rc_file.read_text().strip() or 1)
    ready = re.search(r"guest ready ([0-9.]+) s", serial.read_text(errors="replace"))
    log(
        f"guest exit {rc}, {took:.1f} s in all (guest ready at {ready.group(1) if ready else '?'} s)"
    )
    keep = os.environ.get("NICOFFLOAD_RDMA_VM_KEEP")
    if keep:
        for name in os.listdir(out):
            shutil.copy(out / name, Path(keep) / name)
    shutil.rmtree(out, ignore_errors=True)
    return rc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run(" ".join(command) or PYTEST, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
