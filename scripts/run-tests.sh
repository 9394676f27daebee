#!/usr/bin/env bash
# The CPU test suite as CI runs it. Tests that start Ray need a private network namespace with
# only loopback (TESTING.md); the whole suite runs inside one when `unshare` is available as root.
# pytest's exit code 5 ("no tests ran") is a failure here. The 25 slowest tests are listed (the suite's budget
# is ~10 minutes on 2 cores: what to look at first when it grows).
set -u
cd "$(dirname "$0")/.."
# Debian's Prometheus for the real-Prometheus tests, fetched here: inside the namespace apt has no network.
bash scripts/ensure-prometheus.sh
# Two workers (pytest-xdist): the Ray / operator modules one after another on one of them, every other module on
# whichever is free (tests/conftest.py's SerialFirst). Alone the suite kept ~1.1 of the 2 cores busy.
PYTEST=(.venv/bin/python -m pytest -q --durations=25 -n "${FUSEDSERVE_TEST_WORKERS:-2}" "$@")
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# Tests on the real SmolLM2 use its converted checkpoint, made once per machine into the cache
# (~/.cache/fusedserve): a download, so here, before the private network namespace.
if [ -z "${FUSEDSERVE_NO_FETCH:-}" ]; then
  .venv/bin/fusedserve fetch-model smollm2 >/dev/null || echo "run-tests: fetch-model smollm2 failed (tests on it fail)" >&2
fi
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
  unshare -n sh -c 'ip link set lo up 2>/dev/null || true; exec "$@"' sh "${PYTEST[@]}"
else
  "${PYTEST[@]}"
fi
rc=$?
if [ "$rc" = 5 ]; then
  echo "run-tests: pytest collected no tests — failing" >&2
  exit 1
fi
exit "$rc"
