#!/usr/bin/env bash
# `make run`: serve examples/01-tiny-code.yaml on an embedded Ray, send a completion and a chat
# request, print them with the acceptance length, and exit. Ray probes non-loopback addresses,
# so as root it runs inside a private network namespace with only loopback (TESTING.md).
set -u
cd "$(dirname "$0")/.."
# The embedded Ray runs with token authentication (fusedserve run sets it up) unless RAY_AUTH_MODE says otherwise.
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
CMD=(.venv/bin/fusedserve run "${1:-examples/01-tiny-code.yaml}" --smoke)
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
  exec unshare -n sh -c 'ip link set lo up 2>/dev/null || true; exec "$@"' sh "${CMD[@]}"
fi
exec "${CMD[@]}"
