#!/usr/bin/env bash
# Fetch the host-side probe tools for the H200 into .device-tools/ (ignored by git; pass it in the
# device call's carry): jemalloc (Debian's libjemalloc2, for LD_PRELOAD A/B runs of the host
# time) and py-spy (sampling profiler with native C++ frames). Run on a machine with apt and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device-tools && cd .device-tools
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libjemalloc2 > /dev/null 2>&1 && dpkg-deb -x libjemalloc2_*.deb x)
cp "$(find "$tmp/x" -name 'libjemalloc.so.2' -type f | head -1)" .
rm -rf "$tmp"
python3 -m pip download -q --no-deps --only-binary=:all: py-spy -d . 2>/dev/null
ls -la
