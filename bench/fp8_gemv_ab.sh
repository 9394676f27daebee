#!/bin/bash
# Issue #19, one device call: the FP8 GEMV's GPU tests, its probe beside the engine's block-FP8 GEMMs at 1 / 2 / 4
# rows, then the slice with the defaults (a) and with the GEMV taking 1-4 rows and the one-token MoE on (b):
# 4 layers where the card holds the bf16 build (an H200: a b), else 2 (an H100: a b a b). Run after
# `. bench/device_env.sh`; writes under $OUT.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
bash bench/gpu_real.sh tests -q -k "fp8" 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
timeout 120 python3 -P bench/fp8_gemm_tiles_probe.py --engine-only --gemv --rows 1 2 4 --out "$OUT/fp8-gemv.json" 2>&1 \
  | grep -v '^{' | tail -21
big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 120e9))")
if [ "$big" = 1 ]; then layers=4; order="a b"; limit=200; else layers=2; order="a b a b"; limit=100; fi
i=0
for v in $order; do
  i=$((i + 1))
  set_b=()
  [ "$v" = b ] && set_b=(--set models.layers.fp8_block_gemv_triton.ROWS=4 --set models.layers.fused_moe_fp8_gemv_triton.TOKENS=1)
  timeout $limit python3 -P bench/fp8_slice.py --layers $layers --skip-gemms --profile-batches 1 2 4 --prefill 512 \
    --out "$OUT/slice-$i-$v.json" "${set_b[@]}" 2>&1 | tail -1
done
