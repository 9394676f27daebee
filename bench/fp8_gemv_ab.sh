#!/bin/bash
# Issue #19, one device call: the FP8 GPU tests, the one-row GEMV's probe beside the engine's block-FP8 GEMMs, then
# the slice alternated over four settings: a the defaults; b the dense GEMV at one row (fp8_block_gemv_triton.ROWS=1);
# c that with two K steps loaded ahead (AHEAD=2); d c with the one-token MoE (fused_moe_fp8_gemv_triton.TOKENS=1).
# 4 layers where the card holds the bf16 build (an H200: a c, once), else 2 (an H100: a b c d twice). Run after
# `. bench/device_env.sh`; writes under $OUT.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
bash bench/gpu_real.sh tests -q -k "fp8" 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
timeout 120 python3 -P bench/fp8_gemm_tiles_probe.py --engine-only --gemv --rows 1 --out "$OUT/fp8-gemv.json" 2>&1 \
  | grep -v '^{' | tail -8
big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 120e9))")
if [ "$big" = 1 ]; then layers=4; order="a c"; limit=200; else layers=2; order="a b c d a b c d"; limit=60; fi
g=models.layers.fp8_block_gemv_triton
i=0
for v in $order; do
  i=$((i + 1))
  case $v in
    a) s=() ;;
    b) s=(--set $g.ROWS=1) ;;
    c) s=(--set $g.ROWS=1 --set $g.AHEAD=2) ;;
    d) s=(--set $g.ROWS=1 --set $g.AHEAD=2 --set models.layers.fused_moe_fp8_gemv_triton.TOKENS=1) ;;
  esac
  timeout $limit python3 -P bench/fp8_slice.py --layers $layers --skip-gemms --profile-batches 1 --prefill 512 \
    --out "$OUT/slice-$i-$v.json" "${s[@]}" 2>&1 | tail -1
done
