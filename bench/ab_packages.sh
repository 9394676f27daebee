#!/usr/bin/env bash
# A/B of one bench script between the working tree's package ("new") and other commits' (any other variant
# name X: the tree unpacked in tmp/X), alternated in one device call, the same bench script for all.
#
#   here:        rm -rf tmp/old && mkdir -p tmp/old && git archive <commit> fusedserve models worker operator | tar -x -C tmp/old
#                (one folder per other variant, e.g. tmp/main from another commit)
#   the device:  VARIANTS="new old new old" BENCH_ARGS="--profile-batches 8" bash bench/ab_packages.sh   (carry: tmp)
#
# BENCH: the script and its fixed arguments (default bench/fp8_slice.py --skip-gemms); SITE: a folder put after the
# package on PYTHONPATH (e.g. FlashInfer's /tmp/site); SHOW: the lines of each run's log printed (a grep -E
# pattern). ``bench/gpu_real.sh ab`` runs bench/spec_decode_real.py through it. Writes $OUT/<variant>-<i>.json and
# .log per run. The package is laid out as bench/gpu_fp8.sh does (no install): /tmp/pkg<variant>/fusedserve.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
mkpkg() { mkdir -p "$1/fusedserve" && cp "$2"/fusedserve/*.py "$1/fusedserve/" && for x in models worker operator; do ln -sfn "$2/$x" "$1/fusedserve/$x"; done; }
R=$PWD
VARIANTS=${VARIANTS:-new old new old}
for v in $(echo "$VARIANTS" | tr ' ' '\n' | sort -u); do
  src=$R; [ "$v" = new ] || src=$R/tmp/$v
  [ -d "$src/models" ] || { echo "ab_packages: no tmp/$v (see the header)" >&2; exit 2; }
  rm -rf "/tmp/pkg$v"; mkpkg "/tmp/pkg$v" "$src"
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
i=0
for v in $VARIANTS; do
  i=$((i+1))
  # shellcheck disable=SC2086  # BENCH_ARGS: several arguments
  # shellcheck disable=SC2086  # BENCH: a script and its arguments
  PYTHONPATH=/tmp/pkg$v${SITE:+:$SITE} timeout "${RUN_S:-120}" python3 -P ${BENCH:-bench/fp8_slice.py --skip-gemms} \
    --out "$OUT/$v-$i.json" ${BENCH_ARGS:-} > "$OUT/$v-$i.log" 2>&1
  echo "== $v $i rc $?"
  grep -E "${SHOW:-decode batch|profile batch|Error|error}" "$OUT/$v-$i.log" | sed 's/roofline.*(/(/' | cut -c1-220
done
