#!/usr/bin/env bash
# make test-arm: the DPU agent and its kernels on aarch64, under QEMU user-mode emulation.
#
# Builds (once; cached outside the repository, keyed by the dependency set and the build recipe)
# a Debian bookworm arm64 root filesystem with the agent's dependencies, then for each pinned CPU
# model (QEMU_CPU; none of them has SVE, which the real cores lack): checks what the emulated CPU
# exposes, runs the agent's unit tests and every CPU kernel's contract test inside it, and runs a
# split pipeline whose DPU stage is served by an aarch64 agent in the chroot while the host side
# runs natively, over TCP on loopback, checking the outputs equal the all-host run's bit for bit.
#
# The chroot gets a copy of the sources (the repository is never written) and, per CPU model, a
# numba cache kept in ~/.cache/nicoffload keyed by nicoffload/ops's content: code compiled under
# emulation is only ever loaded again by this harness, never shipped or used on real hardware.
# Each phase prints its time, and each model how many numba cache files it found and left (equal
# numbers: everything was loaded from the cache, nothing compiled).
# Needs root (mmdebstrap, chroot, mount); installs its apt packages when missing.
# Env: TEST_ARM_CPUS (default "cortex-a72 cortex-a76"), TEST_ARM_PYTHON (the host side's python),
# XDG_CACHE_HOME, DEBIAN_MIRROR.
set -euo pipefail
{ # parsed whole before it runs: editing this file mid-run cannot derail it
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${TEST_ARM_PYTHON:-$repo/.venv/bin/python} # the host side: the repository venv
cpus=${TEST_ARM_CPUS:-cortex-a72 cortex-a76}
t0=$SECONDS

if [ "$(id -u)" != 0 ]; then
  echo "test-arm: needs root (mmdebstrap, chroot, binfmt_misc); run it as root or in CI" >&2
  exit 1
fi

missing=""
for p in mmdebstrap arch-test qemu-user-static binfmt-support zstd; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "test-arm: installing$missing" >&2
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends $missing >/dev/null
fi

# A plain `chroot` runs arm64 binaries once qemu-aarch64 is registered with binfmt_misc (flag F:
# the interpreter is opened now, so it need not exist inside the root filesystem).
binfmt=/proc/sys/fs/binfmt_misc
mountpoint -q $binfmt || mount -t binfmt_misc binfmt_misc $binfmt
[ -e $binfmt/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -q '^enabled' $binfmt/qemu-aarch64 && grep -q '^flags:.*F' $binfmt/qemu-aarch64 || {
  echo "test-arm: qemu-aarch64 is not registered with binfmt_misc (flag F)" >&2
  exit 1
}

# Two caches outside the repository: the base from mmdebstrap (minutes to build, keyed by its
# recipe) and the root filesystem with the dependency set (seconds from the base, keyed by the set).
cachedir=${XDG_CACHE_HOME:-$HOME/.cache}/nicoffload
base=$cachedir/arm64-base-$(sha256sum <"$here/build-base.sh" | cut -c1-16).tar.zst
key=$(cat "$here/build-base.sh" "$here/build-rootfs.sh" "$repo/dpu_agents/requirements-dpu.txt" \
  "$here/requirements-test.txt" | sha256sum | cut -c1-16)
cache=$cachedir/arm64-$key.tar.zst
mkdir -p "$cachedir"
(
  flock 9 # two runs at once build it once
  tb=$SECONDS
  [ -f "$base" ] || {
    "$here/build-base.sh" "$base"
    echo "test-arm: base built in $((SECONDS - tb)) s" >&2
  }
  if [ ! -f "$cache" ]; then
    tb=$SECONDS
    PIP="$(dirname "$py")/pip" "$here/build-rootfs.sh" "$base" "$cache"
    echo "test-arm: root filesystem built in $((SECONDS - tb)) s" >&2
    find "$cachedir" -maxdepth 1 -name 'arm64-*.tar.zst' ! -name 'arm64-base-*' \
      ! -path "$cache" -delete # superseded dependency sets
  fi
) 9>"$cachedir/arm64.lock"

work=$(mktemp -d /var/tmp/nicoffload-arm.XXXXXX)
root=$work/rootfs
cleanup() {
  for m in "$root"/tmp/numba-* "$root/dev/shm" "$root/proc"; do
    mountpoint -q "$m" 2>/dev/null && { umount "$m" 2>/dev/null || umount -l "$m"; }
  done
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT
mkdir -p "$root"
zstd -q -dc "$cache" | tar -C "$root" -xf -
mount -t proc proc "$root/proc"            # numba reads /proc/cpuinfo; multiprocessing, /proc/self
mkdir -p "$root/dev/shm" && mount -t tmpfs -o size=512m tmpfs "$root/dev/shm"
mkdir -p "$root/src"
# The sources go in with one fixed mtime, and each model's numba cache (kept outside the
# repository between runs, used only inside this chroot, never shipped) is keyed by the sources'
# content: numba's own staleness check (mtime and size) then cannot be fooled by a fresh clone,
# and a changed source gets a fresh cache.
tar -C "$repo" -cf "$work/src.tar" --sort=name --mtime='2000-01-01 00:00Z' --owner=0 --group=0 \
  --exclude=__pycache__ --exclude='*.nbi' --exclude='*.nbc' \
  pyproject.toml nicoffload dpu_agents pipelines tests/conftest.py tests/kernel_contract.py \
  tests/unit tests/arm
tar -C "$root/src" -xf "$work/src.tar"
# Bytecode for the sources, compiled natively (the root filesystem's site-packages got theirs in
# build-rootfs.sh): an emulated interpreter would otherwise compile every module it imports, on
# every start. (A host python of another version writes files the chroot's ignores.)
"$py" -m compileall -q -j 0 -s "$root" -p / "$root/src" >/dev/null
# Every numba function lives in nicoffload/ops/ and calls only what is there: the cache is keyed by
# that tree (less the GPU kernels' files, gpu_*, which hold no numba code), the interpreter (the
# base) and the DPU set (numba, llvmlite, numpy), so a change elsewhere (tests, agent, planner,
# GPU kernels, test-only packages) keeps it warm.
srckey=$( (cat "$here/build-base.sh" "$repo/dpu_agents/requirements-dpu.txt"
  tar -C "$repo" -cf - --sort=name --mtime='2000-01-01 00:00Z' --owner=0 --group=0 \
    --exclude=__pycache__ --exclude='*.nbi' --exclude='*.nbc' --exclude='gpu_*' nicoffload/ops) |
  sha256sum | cut -c1-16)
find "$cachedir" -maxdepth 1 -name 'arm64-numba-*' ! -name "arm64-numba-*-$srckey" \
  -exec rm -rf {} + 2>/dev/null || true
for cpu in $cpus; do
  mkdir -p "$cachedir/arm64-numba-$cpu-$srckey" "$root/tmp/numba-$cpu"
  mount --bind "$cachedir/arm64-numba-$cpu-$srckey" "$root/tmp/numba-$cpu"
done
echo "test-arm: root filesystem ready ($((SECONDS - t0)) s)" >&2
t1=$SECONDS

# Inside the chroot: nothing from the host's environment but what is listed here. /proc/cpuinfo
# is the host's, so LLVM would see a "generic" Arm CPU: NUMBA_CPU_NAME makes numba compile for the
# emulated model, as it does on a real DPU, where LLVM detects the core.
inside() { # CPU NUMBA_DIR COMMAND...
  local cpu=$1 numba=$2
  shift 2
  QEMU_CPU=$cpu chroot "$root" /usr/bin/env -i QEMU_CPU="$cpu" PATH=/opt/venv/bin:/usr/bin:/bin \
    HOME=/tmp LANG=C.UTF-8 PYTHONPATH=/src PYTHONDONTWRITEBYTECODE=1 NUMBA_CACHE_DIR="$numba" \
    NUMBA_CPU_NAME="$cpu" NICOFFLOAD_CONTRACT=small \
    /bin/sh -c 'cd /src && exec "$@"' sh "$@"
}

# The agent's own tests are ISA-blind Python (protocol, auth, config, batching): they run under the
# first model only. The kernels' contracts (at the small profile: every case and code path, small
# images; see tests/kernel_contract.py) and the split run (numba code, numpy's SIMD dispatch) run
# under every model.
AGENT_TESTS="tests/unit/test_agent_auth.py tests/unit/test_agent_config.py
  tests/unit/test_agent_stage.py"
first=${cpus%% *}
nbfiles() { find "$root/tmp/numba-$1" -type f | wc -l; }
per_cpu() { # CPU: everything for one CPU model (the models run in parallel, each on its own log)
  local cpu=$1 t=$SECONDS n tests=tests/unit/test_kernels_contract.py
  [ "$cpu" != "$first" ] || tests="$AGENT_TESTS $tests"
  n=$(nbfiles "$cpu")
  # The probe, then pytest in the same interpreter: an emulated start (numpy, numba) costs seconds.
  # shellcheck disable=SC2086
  inside "$cpu" "/tmp/numba-$cpu" python tests/arm/probe.py -q -p no:cacheprovider -x \
    --durations=5 $tests
  echo "== test-arm: QEMU_CPU=$cpu: probe and tests $((SECONDS - t)) s;" \
    "numba cache $n files before, $(nbfiles "$cpu") after"
  # The split run's agent shares the model's throwaway numba cache (same model: same code).
  local ts=$SECONDS
  (cd "$repo" && QEMU_CPU=$cpu "$py" "$here/split_run.py" --root "$root" --cpu "$cpu")
  echo "== test-arm: QEMU_CPU=$cpu: split run $((SECONDS - ts)) s; passed in $((SECONDS - t)) s"
}
pids=""
for cpu in $cpus; do
  per_cpu "$cpu" >"$work/$cpu.log" 2>&1 &
  pids="$pids $!"
done
failed=0
set -- $cpus
for pid in $pids; do
  wait "$pid" || failed=1
  echo "== test-arm: QEMU_CPU=$1" >&2
  cat "$work/$1.log" >&2
  shift
done
[ "$failed" = 0 ] || { echo "test-arm: FAILED" >&2; exit 1; }
echo "test-arm: passed in $((SECONDS - t0)) s (the models' runs $((SECONDS - t1)) s)" >&2
exit 0
}
