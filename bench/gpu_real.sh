#!/usr/bin/env bash
# The real pair of issue #15 on the GPU machine (nothing can be downloaded there; one call carries 64 MiB).
# Pack the files here first: `python bench/real_data.py` (-> .whl/real/, ignored). Then, one device call each,
# calls at most ~30 s apart (files in /tmp survive only while the machine stays warm):
#
#   bash bench/gpu_real.sh stage                 carry .whl/real/part1                     (47 MiB)
#   bash bench/gpu_real.sh train [MINUTES]       carry .whl/real/part2 .whl/real/wheels .whl/real/data
#                                                joins + checks the GGUF, converts it (fetch-model --gguf),
#                                                trains the draft (train-draft, MINUTES, default 6.5);
#                                                $OUT/smollm2-eagle3/ and $OUT/train-draft.json come back
#   bash bench/gpu_real.sh bench [ARGS...]       after `stage` + a call carrying part2, wheels, data and
#                                                (for --http) wheels-http + .whl/serving-site-cp312.tar.xz:
#                                                bench/spec_decode_real.py ARGS (draft: $DRAFT, default
#                                                examples/checkpoints/smollm2-eagle3) -> $OUT/spec-decode-real.json
#
# Every command first copies whatever .whl/real/* this call carried into /tmp/real.
set -euo pipefail
cmd=${1:?usage: gpu_real.sh stage|train|bench}
shift
R=/tmp/real
OUT=${OUT:-/tmp/out}
mkdir -p "$R" "$OUT"

stage() {
  for d in part1 part2 wheels wheels-http data; do
    if [ -d ".whl/real/$d" ]; then mkdir -p "$R/$d" && cp -r ".whl/real/$d/." "$R/$d/"; fi
  done
  if [ -f .whl/serving-site-cp312.tar.xz ] && [ ! -d /tmp/serving/ray ]; then
    mkdir -p /tmp/serving && tar -C /tmp/serving -xJf .whl/serving-site-cp312.tar.xz
    echo /tmp/serving > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz-serving.pth"
  fi
  ls -la "$R"/* | head -40
}

layout() {  # the package as `fusedserve` without installing it (bench/device_env.sh does the same)
  mkdir -p /tmp/pkg/fusedserve && cp fusedserve/*.py /tmp/pkg/fusedserve/
  for d in models worker operator; do ln -sfn "$PWD/$d" "/tmp/pkg/fusedserve/$d"; done
  for w in wheels wheels-http; do
    if [ -d "$R/$w" ] && [ ! -f "/tmp/site/.$w" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$R/$w"/*.whl && touch "/tmp/site/.$w"
    fi
  done
  export PYTHONPATH=/tmp/pkg:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TOKENIZERS_PARALLELISM=false
}

model() {  # the converted checkpoint in /tmp/real/smollm2 (once per warm machine)
  if [ ! -f "$R/smollm2/fusedserve-fetch.json" ]; then
    cat "$R/part1/smollm2.gguf.part1" "$R/part2/smollm2.gguf.part2" > "$R/smollm2.gguf"
    python3 -P -m fusedserve.cli fetch-model smollm2 --gguf "$R/smollm2.gguf" --out "$R/smollm2"
    rm -f "$R/smollm2.gguf"
  fi
}

stage
case "$cmd" in
  stage) ;;
  train)
    layout && model
    python3 -P -m fusedserve.cli train-draft --target "$R/smollm2" --data "$R/data/sharegpt.json" \
      --out "$OUT/smollm2-eagle3" --budget-minutes "${1:-6.5}" --log "$OUT/train-draft.json"
    ;;
  bench)
    layout && model
    python3 -P bench/spec_decode_real.py --target "$R/smollm2" --draft "${DRAFT:-$PWD/examples/checkpoints/smollm2-eagle3}" \
      --data-dir "$R/data" --out "$OUT/spec-decode-real.json" "$@"
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
