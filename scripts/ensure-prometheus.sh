#!/usr/bin/env bash
# Debian's `prometheus` package (server + promtool, 2.42 on bookworm) for the real-Prometheus tests.
#
# Nothing to do when both binaries are on PATH or already under .cache/prometheus/. Otherwise apt fetches the
# package (`apt-get download`: signature and hash checked as for any install; as root an `apt-get update` first
# when the lists are missing or stale) and only its two binaries are unpacked into .cache/prometheus/bin/.
# Unpacking instead of `apt-get install` leaves the machine as it was: the package's postinst would add a
# system user and start a Prometheus daemon on :9090 through invoke-rc.d. Run outside the tests' private
# network namespace (scripts/run-tests.sh does): apt needs the network. Never fails the caller: when nothing
# can be fetched it says why, and the tests skip loudly (or fail, with FUSEDSERVE_REQUIRE_PROMETHEUS=1 as CI).
set -u
cd "$(dirname "$0")/.."
DEST=.cache/prometheus/bin

if { command -v prometheus && command -v promtool; } >/dev/null 2>&1; then
  exit 0
fi
if [ -x "$DEST/prometheus" ] && [ -x "$DEST/promtool" ]; then
  exit 0
fi
say() { echo "ensure-prometheus: $*" >&2; }
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  say "no apt-get/dpkg-deb here: install Prometheus 2.x (server and promtool) yourself, or the tests skip"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fetch() { (cd "$work" && apt-get download -q prometheus >"$work/apt.log" 2>&1); }
if ! fetch; then
  if [ "$(id -u)" = 0 ]; then
    say "apt-get download failed; running apt-get update"
    apt-get update -q >"$work/update.log" 2>&1 || { say "apt-get update failed:"; tail -5 "$work/update.log" >&2; }
    fetch || true
  fi
fi
deb=$(ls "$work"/prometheus_*.deb 2>/dev/null | head -1)
if [ -z "$deb" ]; then
  say "could not fetch Debian's prometheus package (not root, or no apt source reachable):"
  tail -5 "$work/apt.log" >&2
  exit 0
fi
dpkg-deb -x "$deb" "$work/root"
mkdir -p "$DEST"
cp "$work/root/usr/bin/prometheus" "$work/root/usr/bin/promtool" "$DEST/"
say "unpacked $(basename "$deb") into $DEST ($("$DEST/prometheus" --version 2>&1 | head -1))"
