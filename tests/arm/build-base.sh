#!/usr/bin/env bash
# The base of the test-arm root filesystem, packed into $1 (.tar.zst): Debian bookworm arm64, its
# Essential packages + python3. Minutes (the packages' configuration runs emulated), so it is
# cached on its own, keyed by this file: a change of the dependency set reuses it.
set -euo pipefail
out=$1
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d /var/tmp/nicoffload-arm-base.XXXXXX)
trap 'rm -rf "$work"' EXIT

echo "test-arm: mmdebstrap bookworm arm64 (minutes; cached afterwards)" >&2
# mmdebstrap rather than debootstrap: one dpkg run for all packages (each emulated process costs):
# 164-185 s against debootstrap's 213 s here (load 1-1.7). The essential variant: no apt (nothing
# is installed in the chroot; build-rootfs.sh fills the venv from the host). libstdc++6: llvmlite
# and tokenizers link it (manylinux allows it). No python3-venv: `venv --without-pip` needs none
# of it, and it pulls ca-certificates (whose postinst forks a process per certificate, each
# emulated), openssl and pip's wheels. Never unpacked: documentation, manuals, locales.
mmdebstrap --quiet --arch=arm64 --variant=essential --include=python3,libstdc++6 --mode=root \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  bookworm "$work/base.tar" "$mirror" >"$work/mmdebstrap.log" 2>&1 || {
  tail -30 "$work/mmdebstrap.log" >&2
  exit 1
}
mkdir -p "$(dirname "$out")"
zstd -q -T0 -3 "$work/base.tar" -o "$out.tmp.$$"
mv "$out.tmp.$$" "$out"
