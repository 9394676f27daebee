#!/bin/bash
# Issue #19, one device call: the FP8 GPU tests, the one-row GEMV's probe beside the block-FP8 GEMMs, then the slice
# with the defaults (a: one row through fp8_block_gemv_triton) and without the GEMV (b: ROWS=0, the w8a8 GEMM and
# scaled_mm as before), alternated: 4 layers where the card holds the bf16 build (an H200: a b), else 2 (an H100:
# a b a b). Run after `. bench/device_env.sh`; writes under $OUT. SKIP_TESTS=1: not the tests.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
[ "${SKIP_TESTS:-0}" = 1 ] || bash bench/gpu_real.sh tests -q -k "fp8" 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
timeout 120 python3 -P bench/fp8_gemm_tiles_probe.py --engine-only --gemv --rows 1 --out "$OUT/fp8-gemv.json" 2>&1 \
  | grep -v '^{' | tail -8
big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 120e9))")
if [ "$big" = 1 ]; then layers=4; order="a b"; limit=200; else layers=2; order="a b a b"; limit=60; fi
i=0
for v in $order; do
  i=$((i + 1))
  s=()
  [ "$v" = b ] && s=(--set models.layers.fp8_block_gemv_triton.ROWS=0)
  timeout $limit python3 -P bench/fp8_slice.py --layers $layers --skip-gemms --profile-batches 1 2 4 --prefill 512 \
    --out "$OUT/slice-$i-$v.json" "${s[@]}" 2>&1 | tail -1
done
