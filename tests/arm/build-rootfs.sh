#!/usr/bin/env bash
# The test-arm root filesystem, packed into $2 (.tar.zst): the base ($1, from build-base.sh) plus
# a venv at /opt/venv whose site-packages are filled from the host with the aarch64 wheels of
# dpu_agents/requirements-dpu.txt and tests/arm/requirements-test.txt (pip --platform --target:
# seconds, where installing under emulation takes minutes), with their bytecode. Cached keyed by
# the dependency set.
set -euo pipefail
base=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
pip=${PIP:-$repo/.venv/bin/pip}
work=$(mktemp -d /var/tmp/nicoffload-arm-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"
zstd -q -dc "$base" | tar -C "$root" -xf -

chroot "$root" /usr/bin/python3 -m venv --without-pip /opt/venv
site=$(echo "$root"/opt/venv/lib/python3.*/site-packages)
pyver=$(basename "$(dirname "$site")" | sed 's/python//; s/\.//')
echo "test-arm: aarch64 wheels for cp$pyver into the venv" >&2
"$pip" install --quiet --disable-pip-version-check --no-deps --no-compile --only-binary=:all: \
  --platform manylinux_2_17_aarch64 --platform manylinux_2_27_aarch64 \
  --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
  --python-version "$pyver" --implementation cp --abi "cp$pyver" --abi abi3 --abi none \
  --target "$site" -r "$repo/dpu_agents/requirements-dpu.txt" -r "$here/requirements-test.txt"
# Their bytecode, compiled here natively by an interpreter of the same version (bytecode is fixed
# within a minor version): an emulated interpreter would otherwise compile every module it imports
# on every start (numba's import alone: seconds).
pyc=$("$(dirname "$pip")/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
[ "$pyc" = "$pyver" ] || {
  echo "test-arm: the host python is $pyc, the root filesystem's $pyver: set TEST_ARM_PYTHON" >&2
  exit 1
}
"$(dirname "$pip")/python" -m compileall -q -j 0 -s "$root" -p / "$site" >/dev/null

tar -C "$root" --numeric-owner -cf - . | zstd -q -T0 -3 -o "$out.tmp.$$"
mv "$out.tmp.$$" "$out"
echo "test-arm: cached $(du -h "$out" | cut -f1) in $out" >&2
