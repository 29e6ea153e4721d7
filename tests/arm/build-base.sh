#!/usr/bin/env bash
# The base of the test-arm root filesystem, packed into $1 (.tar.zst): Debian bookworm arm64,
# minbase + python3. Minutes (debootstrap's second stage runs emulated), so it is cached on its
# own, keyed by this file: a change of the dependency set reuses it.
set -euo pipefail
out=$1
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d /var/tmp/nicoffload-arm-base.XXXXXX)
trap 'umount -l "$work/rootfs/proc" 2>/dev/null || true; rm -rf "$work"' EXIT
root=$work/rootfs

echo "test-arm: debootstrap bookworm arm64 (minutes; cached afterwards)" >&2
# libstdc++6: llvmlite and tokenizers link it (manylinux allows it; minbase lacks it). No
# python3-venv: `venv --without-pip` needs none of it, and it pulls ca-certificates (whose
# postinst forks a process per certificate, each emulated), openssl and pip's wheels.
debootstrap --arch=arm64 --variant=minbase --include=python3,libstdc++6 \
  bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -30 "$work/debootstrap.log" >&2
  exit 1
}
# What the tests never read: apt's downloads and lists, documentation, locales.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
  "$root"/usr/share/doc "$root"/usr/share/man "$root"/usr/share/locale
mkdir -p "$(dirname "$out")"
tar -C "$root" --numeric-owner -cf - . | zstd -q -T0 -3 -o "$out.tmp.$$"
mv "$out.tmp.$$" "$out"
