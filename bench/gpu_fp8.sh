#!/usr/bin/env bash
# Issue #19 on one H200 in ONE device call (8 minutes at most): the FP8 GPU tests (tests/test_gpu_fp8.py,
# -m gpu), then bench/fp8_slice.py (the DeepSeek-V3-shaped slice in block FP8 against the same weights in
# bf16, and the GEMM table). Needs only the working tree: the slice runs the Triton kernel set (no
# FlashInfer, no Ray, nothing to carry), and the machine has torch, triton and transformers.
#
#   FUSEDSERVE_COMMIT=<sha> bash bench/gpu_fp8.sh      on the device; writes under $OUT:
#     gpu-fp8-tests.json   date, machine, commit, command, counts, each test's outcome and seconds
#     fp8-slice.json       bench/fp8_slice.py's record (rewritten after each stage: "complete" says if it ended)
#     gpu-fp8-tests.log, fp8-slice.log
#   GPU_FP8_TINY=1 PY=.venv/bin/python bash bench/gpu_fp8.sh     here, on CPU: the same steps at tiny shapes
#
# Stops at once (exit 3) when the machine cannot run it (no CUDA GPU with FP8 tensor cores, Triton or
# transformers missing); otherwise runs both parts, each within its time limit, and exits nonzero if
# either failed (the bench itself stops early and says why on a failed preflight or non-finite result).
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}
T=${GPU_FP8_TMP:-/tmp/gpu-fp8}
TINY=${GPU_FP8_TINY:-}
LIMIT_S=${GPU_FP8_LIMIT_S:-460}  # the whole script; the device call allows 480 s here
TESTS_S=${GPU_FP8_TESTS_S:-150}
REPO=$PWD
mkdir -p "$OUT" "$T/cwd"
say() { echo "[gpu_fp8 ${SECONDS}s] $*" >&2; }

# The package as `fusedserve` without installing it (as bench/device_env.sh, without the wheels).
rm -rf "$T/pkg" && mkdir -p "$T/pkg/fusedserve" && cp fusedserve/*.py "$T/pkg/fusedserve/"
for d in models worker operator; do ln -sfn "$REPO/$d" "$T/pkg/fusedserve/$d"; done
export PYTHONPATH=$T/pkg NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export FUSEDSERVE_COMMIT=${FUSEDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

cd "$T/cwd"  # not the checkout: its folder fusedserve/ (the CLI only) would hide the laid-out package
if ! "$PY" -P - "$TINY" <<'EOF'
import sys
import torch, transformers  # noqa: F401
import fusedserve.models.layers.fp8_block  # noqa: F401
tiny = bool(sys.argv[1])
if not tiny:
    import triton  # noqa: F401
    if not torch.cuda.is_available():
        sys.exit("gpu_fp8: no CUDA GPU here (GPU_FP8_TINY=1 runs the CPU dry run)")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        sys.exit(f"gpu_fp8: {torch.cuda.get_device_name()} is SM{cap[0]}{cap[1]}: FP8 needs SM89+")
    print(f"gpu_fp8: {torch.cuda.device_count()}x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, transformers {transformers.__version__}", file=sys.stderr)
EOF
then
  say "this machine cannot run the FP8 benchmark"; exit 3
fi

say "FP8 GPU tests (at most ${TESTS_S}s)"
timeout "$TESTS_S" "$PY" -P -m pytest -q -m gpu -p no:cacheprovider "$REPO/tests/test_gpu_fp8.py" \
  --junitxml="$T/gpu-fp8-tests.xml" 2>&1 | tee "$OUT/gpu-fp8-tests.log"
tests_rc=${PIPESTATUS[0]}
"$PY" -P - "$T/gpu-fp8-tests.xml" "$OUT/gpu-fp8-tests.json" "$tests_rc" "$TESTS_S" <<'EOF'
import datetime, json, os, sys, xml.etree.ElementTree as ET
import torch
xml, out, rc, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
cases = []
if os.path.exists(xml):
    for c in ET.parse(xml).iter("testcase"):
        kind = next((k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed")
        detail = next((k.get("message", "")[:300] for k in c if k.tag in ("failure", "error", "skipped")), "")
        cases.append({"test": f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}", "outcome": kind,
                      "seconds": float(c.get("time", 0)), **({"detail": detail} if detail else {})})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
json.dump({"date": str(datetime.date.today()),
           "machine": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available()
           else "cpu", "commit": os.environ.get("FUSEDSERVE_COMMIT"),
           "command": "bash bench/gpu_fp8.sh: python -m pytest -q -m gpu tests/test_gpu_fp8.py",
           "exit_status": rc, "timed_out": rc in (124, 137), "limit_s": int(limit),
           "counts": counts, "tests": cases}, open(out, "w"), indent=1)
print(f"gpu_fp8: tests exit {rc}: {counts}", file=sys.stderr)
EOF

left=$((LIMIT_S - SECONDS))
[ "$left" -lt 60 ] && left=60
say "bench/fp8_slice.py (at most ${left}s)"
bench_args=(--out "$OUT/fp8-slice.json")
[ -n "$TINY" ] && bench_args+=(--tiny)
timeout "$left" "$PY" -P "$REPO/bench/fp8_slice.py" "${bench_args[@]}" "$@" 2>&1 | tee "$OUT/fp8-slice.log"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" = 124 ] && say "bench/fp8_slice.py ran past ${left}s: $OUT/fp8-slice.json holds the stages it finished"
say "done: tests exit $tests_rc, bench exit $bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
