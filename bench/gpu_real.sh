#!/usr/bin/env bash
# The real pair of issue #15 on the GPU machine: nothing can be downloaded there and one device call carries
# 64 MiB (the project's files included), so `python bench/real_data.py` packs everything into .whl/real/
# (ignored) beforehand, and the calls below carry it in pieces. /tmp survives between calls only while the
# machine stays warm (calls at most ~30 s apart); every command first copies what its call carried into
# /tmp/real and unpacks a carried .whl/serving-site-cp312.tar.xz.
#
#   bash bench/gpu_real.sh stage            carry e.g. .whl/real/part1 .whl/real/part2
#   bash bench/gpu_real.sh train [MINUTES [ARGS]]  carry .whl/real/part3 .whl/real/part4 .whl/real/wheels
#                                           .whl/real/data-train: joins and checks the GGUF, converts it
#                                           (fusedserve fetch-model --gguf), trains the draft (fusedserve
#                                           train-draft, MINUTES, default 6.5) into /tmp/real/smollm2-eagle3;
#                                           on the pairs of carried .whl/real/pairs/*.pt (`--pairs`, no
#                                           regeneration) when there are some, from a carried
#                                           .whl/real/draft-init (`--init`: config.json and model.safetensors
#                                           or its .part* files) when there is one; $OUT/train-draft.json and
#                                           $OUT/smollm2-eagle3/ come back, model.safetensors in 15 MiB parts
#                                           (a returned file is at most 16 MiB): join them here with
#                                           `cat model.safetensors.part* > model.safetensors`
#   bash bench/gpu_real.sh regen [MINUTES [ARGS]]  carry as for train: regeneration only, the whole budget
#                                           (fusedserve train-draft --regen-only, MINUTES, default 8.5)
#                                           -> $OUT/pairs.pt (~5 MB for 8 500 first-turn pairs; over 15 MiB
#                                           in parts pairs.pt.part00, 01, ...: carry them as they are in
#                                           .whl/real/pairs/, `train` joins them) and $OUT/regen.json
#   bash bench/gpu_real.sh decode [ARGS]    issue #14: bench/decode_engine.py ARGS -> $OUT/decode-engine.json
#                                           (carry the FlashInfer files: .whl/*.whl, .whl/flashinfer-aot-*.tar.gz)
#   bash bench/gpu_real.sh decodes V1 V2 ... issue #14: bench/decode_engine.py --decode-only --no-peer per variant (each
#                                           a quoted string of --set / --drop arguments, "" the defaults), alternated
#                                           over ROUNDS (2) rounds, one table of them (bench/decode_table.py)
#                                           -> $OUT/decode-table.json (carry the FlashInfer files as for decode)
#   bash bench/gpu_real.sh serve            issue #14: bench/serve_load.py on the engine in-process and through
#                                           `fusedserve run bench/llama-8b-shape.yaml` -> $OUT/serve-engine.json,
#                                           serve-http.json (carry .whl/serving-site-cp312.tar.xz and
#                                           .whl/sharegpt-requests.json; FlashInfer staged by an earlier call)
#   bash bench/gpu_real.sh bench [ARGS...]  bench/spec_decode_real.py ARGS on /tmp/real/smollm2 and the draft
#                                           ($DRAFT, else /tmp/real/smollm2-eagle3, else a carried
#                                           .whl/real/draft, else examples/checkpoints/smollm2-eagle3)
#                                           -> $OUT/spec-decode-real.json; FlashInfer when a call carried
#                                           .whl/*.whl and .whl/flashinfer-aot-*.tar.gz (without it the
#                                           verify and draft steps fall back to gather attention);
#                                           needs .whl/real/data carried once, and for --http the serving site
#                                           (.whl/serving-site-cp312.tar.xz) and .whl/real/wheels-http
#   bash bench/gpu_real.sh ab [ARGS...]     bench/spec_decode_real.py ARGS for each of VARIANTS ("new old new old":
#                                           this tree's package and tmp/old's, a `git archive` of another commit,
#                                           carried as tmp) alternated in one lease (bench/ab_packages.sh)
#                                           -> $OUT/<variant>-<i>.json
#   bash bench/gpu_real.sh probes V1 V2 ... bench/graph_launch_probe.py --timeline per variant (each a quoted string
#                                           of --set / --drop arguments, "" the defaults), alternated over ROUNDS
#                                           (2) rounds, one table of them (bench/probe_table.py) -> $OUT/probe-table.json
#   bash bench/gpu_real.sh tests [ARGS]     the -m gpu suite (FlashInfer staged) -> $OUT/gpu-tests.xml (junit)
#   bash bench/gpu_real.sh growth [ARGS]    bench/tree_growth_gpu.py ARGS (no model needed) -> $OUT/tree-growth.json
#   bash bench/gpu_real.sh handoff [ARGS]   bench/output_handoff.py ARGS on /tmp/real/smollm2, plain and chain-7
#                                           -> $OUT/output-handoff.json, output-handoff-chain-7.json
#
# A device session, in calls back to back (the machine goes back after 30 s idle, and a fresh one costs
# 1-3 minutes of the session's device time before the first command runs; read the results afterwards):
#   1. carry the 6 FlashInfer files (bench/device_env.sh; move examples/checkpoints/smollm2-eagle3 out of the
#      tree for this call: the tree plus those files must stay under 64 MiB): `tests`, then `decode`
#   2. carry .whl/serving-site-cp312.tar.xz .whl/sharegpt-requests.json: `serve`
#   3. carry .whl/real/part1 part2 data wheels: `stage`;  4. carry part3 part4: `stage`
#   5. carry .whl/real/draft (a copy of the shipped draft): `bench ...`
# The SmolLM2 pair alone in three calls (2026-12-05; the tracked tree without bench/results, docs/images and
# examples/checkpoints/* is 3.4 MB, so move those out of the tree first, and back afterwards):
#   1. carry .whl/real/part1 part2 data wheels and the tvm-ffi, cuda-tile and nccl4py wheels: `stage`
#   2. carry part3 part4 and .whl/flashinfer-aot-0*.tar.gz: `stage`, then `probe --help` (converts the GGUF)
#   3. examples/checkpoints/smollm2-eagle3 back in the tree; carry the FlashInfer wheel,
#      .whl/flashinfer-aot-attention-*.tar.gz and tmp (65 MB): `probe ...`, `bench ...`, `ab ...` (later calls
#      carry nothing more); for `tests` put the tiny checkpoints back instead of the draft
# A draft over two calls (regeneration and training no longer share one call's 10 minutes):
#   1. carry .whl/real/part1 part2 wheels data-train: `stage` (examples/checkpoints/smollm2-eagle3 moved out
#      of the tree for this call, as above);  2. carry part3 part4: `regen 8.5 --num-prompts 11000`;
#      then here: mkdir -p .whl/real/pairs && cp <files_at>/pairs.pt* .whl/real/pairs/
#   3. back to back (the converted model stays in /tmp/real), carry .whl/real/pairs: `train 8.6` (no
#      regeneration: the whole budget trains); then here, in <files_at>/smollm2-eagle3:
#      cat model.safetensors.part* > model.safetensors && rm model.safetensors.part*
#   More prompts (the package's ShareGPT file is cut off after 17 671 conversations: the ~10 650 first turns are
#   all used): `python bench/real_data.py` also packs data-train/sharegpt-turns.json.gz (5.4 MiB), the later human
#   turns with the conversation before each; regenerate on them with `regen 8.5 --data
#   /tmp/real/data-train/sharegpt-turns.json.gz --turns all --max-prompt-tokens 768 --num-prompts 20000` (the
#   first turns of those conversations too: 18 444 prompts fit 768 tokens, 242 on average; the later --data
#   wins), data-train carried with part3 part4 rather than beside part1 part2. `train` keeps the target's
#   features on the GPU, ~4.6 kB a position for SmolLM2: ~40 GB for ~18 000 such pairs. The earlier 8 571 pairs are not
#   kept here: train on the new ones, warm from the shipped draft.
#   Stage FlashInfer (its wheel and attention modules, a call of their own) before `regen`: the all-turn
#   regeneration ran at 15 088 tokens/s with it and 8 704 without (2026-12-05, H100s). A second regeneration with
#   `--seed 1` answers the prompts anew (other order, other sampling seeds; T = 0 answers that repeat are dropped as
#   duplicates); rename its pairs.pt* to e.g. pairs-seed1.pt* beside the first file, and `train` takes both.
#   To go on from that draft in a later call: copy it (joined or in parts) to .whl/real/draft-init and carry it
#   with the pairs. On a fresh machine `train` needs the GGUF again: `stage` with part1 part2, then part3 part4
#   with the pairs (without draft-init: 64 MiB). The shipped draft was made so on 2026-12-05 (stage; stage with
#   the FlashInfer wheel and both module archives; regen 7.0 --seed 1 on the later turns with part3 part4; train 7.5
#   on that file and the first one with the earlier draft as draft-init, all back to back: 58 MB that call). (`--sharegpt-skip 12000`
#   gives no further first turns: the file holds no more; use the later turns above.)
# FlashInfer's six files (44 MB) need not ride in one call: `stage` keeps whichever of them a call carried
# (e.g. flashinfer-aot-attention-*.tar.gz with part1 part2, flashinfer-aot-0*.tar.gz with part3 part4, the four
# wheels with the call that runs), and the first command that lays the package out installs them.
set -euo pipefail
cmd=${1:?usage: gpu_real.sh stage|train|regen|bench|ab|probe|probes|handoff|growth|decode|decodes|serve|tests [args]}
shift
T=${GPU_REAL_TMP:-/tmp}  # where the staged files live (the device: /tmp)
R=$T/real
OUT=${OUT:-/tmp/out}
mkdir -p "$R" "$OUT"

stage() {
  for d in part1 part2 part3 part4 wheels wheels-http data data-train draft; do
    if [ -d ".whl/real/$d" ]; then mkdir -p "$R/$d" && cp -r ".whl/real/$d/." "$R/$d/"; fi
  done
  # FlashInfer (the fast kernel set): its wheels and prebuilt modules, carried as .whl/*.whl and
  # .whl/flashinfer-aot-*.tar.gz (bench/device_env.sh's files), in one call or spread over several
  for w in .whl/*.whl; do if [ -f "$w" ]; then mkdir -p $T/fi && cp "$w" $T/fi/; fi; done
  for t in .whl/flashinfer-aot-*.tar.gz; do if [ -f "$t" ]; then mkdir -p $T/fi && cp "$t" $T/fi/; fi; done
  if [ -f .whl/serving-site-cp312.tar.xz ] && [ ! -d $T/serving/ray ]; then
    mkdir -p $T/serving && tar -C $T/serving -xJf .whl/serving-site-cp312.tar.xz
    echo $T/serving > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz-serving.pth"
  fi
  du -sh "$R"/* $T/serving 2>/dev/null || true
}

layout() {  # the package as `fusedserve` without installing it (as bench/device_env.sh)
  mkdir -p $T/pkg/fusedserve && cp fusedserve/*.py $T/pkg/fusedserve/
  for d in models worker operator; do ln -sfn "$PWD/$d" "$T/pkg/fusedserve/$d"; done
  for w in wheels wheels-http; do
    if [ -d "$R/$w" ] && [ ! -f "$T/site/.$w" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target $T/site "$R/$w"/*.whl && touch "$T/site/.$w"
    fi
  done
  # (run as a plain command, not in an && list: bash ignores set -e inside a function called from one, which
  # once marked FlashInfer installed after its wheels were missing)
  if [ ! -f "$T/site/.flashinfer" ] && ls $T/fi/flashinfer_python-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target $T/site $T/fi/*.whl
    mkdir -p $T/site/flashinfer/data && for t in $T/fi/flashinfer-aot-*.tar.gz; do tar -C $T/site/flashinfer/data -xzf "$t"; done
    touch "$T/site/.flashinfer"
  fi
  export FLASHINFER_WORKSPACE_BASE=$T/flashinfer-ws
  export PYTHONPATH=$T/pkg:$T/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TOKENIZERS_PARALLELISM=false
}

alternate() {  # RUN VARIANT...: `RUN ROUND I VARIANT` for each variant in turn, over ROUNDS (default 2) rounds (an A/B
               # alternated in one lease); a failed run is said and the others go on
  local run=$1 round i variant; shift
  for round in $(seq 1 "${ROUNDS:-2}"); do
    i=0
    for variant in "$@"; do
      i=$((i + 1))
      "$run" "$round" "$i" "$variant" || echo "$cmd: variant $i ($variant), round $round failed ($OUT)" >&2
    done
  done
}

model() {  # the converted checkpoint /tmp/real/smollm2 (once per warm machine); -P: not the checkout's fusedserve/
  if [ ! -f "$R/smollm2/fusedserve-fetch.json" ]; then
    cat "$R"/part1/*.part1 "$R"/part2/*.part2 "$R"/part3/*.part3 "$R"/part4/*.part4 > "$R/smollm2.gguf"
    python3 -P -m fusedserve.cli fetch-model smollm2 --gguf "$R/smollm2.gguf" --out "$R/smollm2"
    rm -f "$R/smollm2.gguf"
  fi
}

stage
case "$cmd" in
  stage) ;;
  train)
    layout; model
    pairs=""  # carried pairs (no regeneration), else the ShareGPT prompts; a file `regen` split comes as
    for p0 in .whl/real/pairs/*.pt.part00; do  # NAME.pt.part00, .part01, ...: joined here into $R/pairs/NAME.pt
      if [ -f "$p0" ]; then mkdir -p "$R/pairs" && cat "${p0%.part00}".part* > "$R/pairs/$(basename "${p0%.part00}")"; fi
    done
    for f in .whl/real/pairs/*.pt "$R"/pairs/*.pt; do if [ -f "$f" ]; then pairs=${pairs:+$pairs,}$(realpath "$f"); fi; done
    if [ -n "$pairs" ]; then src=(--pairs "$pairs"); else src=(--data "$R/data-train/sharegpt.json"); fi
    if [ -d .whl/real/draft-init ]; then  # a draft to start from, whole or in the parts `train` returns
      rm -rf "$R/draft-init" && mkdir -p "$R/draft-init" && cp .whl/real/draft-init/config.json "$R/draft-init/"
      if [ -f .whl/real/draft-init/model.safetensors ]; then cp .whl/real/draft-init/model.safetensors "$R/draft-init/"
      else cat .whl/real/draft-init/model.safetensors.part* > "$R/draft-init/model.safetensors"; fi
      src+=(--init "$R/draft-init")
    fi
    python3 -P -m fusedserve.cli train-draft --target "$R/smollm2" "${src[@]}" \
      --out "$R/smollm2-eagle3" --budget-minutes "${1:-6.5}" --log "$OUT/train-draft.json" "${@:2}"
    mkdir -p "$OUT/smollm2-eagle3" && cp "$R/smollm2-eagle3/config.json" "$OUT/smollm2-eagle3/"
    split -b 15M -d "$R/smollm2-eagle3/model.safetensors" "$OUT/smollm2-eagle3/model.safetensors.part"
    ;;
  regen)  # regeneration only, for a later `train` (carried as .whl/real/pairs/*.pt)
    layout; model
    python3 -P -m fusedserve.cli train-draft --target "$R/smollm2" --data "$R/data-train/sharegpt.json" \
      --regen-only --save-pairs "$OUT/pairs.pt" --budget-minutes "${1:-8.5}" --log "$OUT/regen.json" "${@:2}"
    # a returned file is at most 16 MiB: later turns' long prompts make a bigger file (~25 MB for 17 000 pairs)
    if [ "$(stat -c %s "$OUT/pairs.pt")" -gt $((15 << 20)) ]; then
      split -b 15M -d "$OUT/pairs.pt" "$OUT/pairs.pt.part" && rm "$OUT/pairs.pt"
    fi
    ;;
  bench)
    layout; model
    draft=${DRAFT:-$R/smollm2-eagle3}
    [ -d "$draft" ] || draft=$R/draft  # carried as .whl/real/draft
    [ -d "$draft" ] || draft=$PWD/examples/checkpoints/smollm2-eagle3
    python3 -P bench/spec_decode_real.py --target "$R/smollm2" --draft "$draft" --data-dir "$R/data" \
      --out "$OUT/spec-decode-real.json" "$@"
    ;;
  ab)  # bench/spec_decode_real.py ARGS for each of $VARIANTS (default "new old new old") alternated in one lease,
       # through bench/ab_packages.sh: new = this tree's package, X = tmp/X (here: git archive <commit> fusedserve
       # models worker operator | tar -x -C tmp/X; carry tmp) -> $OUT/<variant>-<i>.json and .log
    layout; model
    draft=$R/draft; [ -d "$draft" ] || draft=$PWD/examples/checkpoints/smollm2-eagle3
    BENCH="bench/spec_decode_real.py --target $R/smollm2 --draft $draft --data-dir $R/data" SITE=$T/site \
      SHOW="tok/s|Error|error" BENCH_ARGS="$*" RUN_S=${RUN_S:-300} bash bench/ab_packages.sh
    ;;
  probe)  # bench/graph_launch_probe.py: each captured graph's host launch time (engine none / chain-3 on SmolLM2)
    layout; model
    draft=$R/draft; [ -d "$draft" ] || draft=$PWD/examples/checkpoints/smollm2-eagle3
    python3 -P bench/graph_launch_probe.py --target "$R/smollm2" --draft "$draft" --out "$OUT/graph-launch.json" "$@"
    ;;
  probes)  # graph_launch_probe --timeline once per variant, the variants alternated over ROUNDS (default 2) rounds;
          # each argument is one variant's --set / --drop arguments in one string ("" = the defaults), e.g.
          #   bash bench/gpu_real.sh probes "" "--set models.layers.linear_triton.L2_PREFETCH_K_MAX=2048"
          # -> $OUT/probe-<round>-<variant>/graph-launch.json (and .log) and bench/probe_table.py's table of
          # them, $OUT/probe-table.json (CONFIGS: the configurations, default none,chain-7; PROBE_S: a run's limit)
    layout; model
    draft=$R/draft; [ -d "$draft" ] || draft=$PWD/examples/checkpoints/smollm2-eagle3
    probe_run() {  # ROUND I VARIANT
      local d="$OUT/probe-$1-$2"; mkdir -p "$d"
      # shellcheck disable=SC2086  # a variant: several arguments in one string
      timeout "${PROBE_S:-90}" python3 -P bench/graph_launch_probe.py --target "$R/smollm2" --draft "$draft" \
        --configs "${CONFIGS:-none,chain-7}" --timeline $3 --out "$d/graph-launch.json" > "$d/log" 2>&1
    }
    alternate probe_run "$@"
    python3 bench/probe_table.py "$OUT"/probe-*/graph-launch.json --out "$OUT/probe-table.json"
    ;;
  handoff)  # bench/output_handoff.py on SmolLM2 (plain, then chain-7 with the draft) -> $OUT/output-handoff{,-chain-7}.json
    layout; model
    draft=$R/draft; [ -d "$draft" ] || draft=$PWD/examples/checkpoints/smollm2-eagle3
    python3 -P bench/output_handoff.py --model "$R/smollm2" --out "$OUT/output-handoff.json" "$@"
    python3 -P bench/output_handoff.py --model "$R/smollm2" --draft "$draft" --steps 7 \
      --out "$OUT/output-handoff-chain-7.json" "$@"
    ;;
  growth)  # bench/tree_growth_gpu.py: one draft tree round's growth, torch ops vs the fused step -> $OUT/tree-growth.json
    layout
    python3 -P bench/tree_growth_gpu.py --out "$OUT/tree-growth.json" "$@"
    ;;
  decode)  # issue #14: bench/decode_engine.py (8B shape, engine vs the HF static-cache peer) -> $OUT/decode-engine.json
    layout
    python3 -P bench/decode_engine.py --out "$OUT/decode-engine.json" "$@"
    ;;
  decodes)  # issue #14: bench/decode_engine.py --decode-only --no-peer once per variant, the variants alternated over
           # ROUNDS (default 2) rounds; each argument is one variant's --set / --drop arguments in one string
           # ("" = the defaults), e.g.
           #   bash bench/gpu_real.sh decodes "" "--set models.layers.linear_triton.SPLIT_K_MAX=1"
           # -> $OUT/decode-<round>-<variant>.json (and .log) and bench/decode_table.py's table of them,
           # $OUT/decode-table.json (DECODE_ARGS: the runs' other arguments, default --batches 16,64 --steps 64;
           # DECODE_S: a run's limit, default 110 s; carry the FlashInfer files as for decode)
    layout
    decode_run() {  # ROUND I VARIANT
      local rc=0
      # shellcheck disable=SC2086  # a variant, and DECODE_ARGS: several arguments in one string
      timeout "${DECODE_S:-110}" python3 -P bench/decode_engine.py --decode-only --no-peer \
        ${DECODE_ARGS:---batches 16,64 --steps 64} $3 --out "$OUT/decode-$1-$2.json" > "$OUT/decode-$1-$2.log" 2>&1 \
        || rc=$?
      grep -o "batch [0-9]*: .*" "$OUT/decode-$1-$2.log" | sed "s/^/decodes: $1-$2 /" || true
      return $rc
    }
    alternate decode_run "$@"
    python3 bench/decode_table.py "$OUT"/decode-*-*.json --out "$OUT/decode-table.json"
    ;;
  serve)  # issue #14: ShareGPT load on the engine in-process, then through `fusedserve run` (Ray + HTTP);
          # carry .whl/serving-site-cp312.tar.xz and .whl/sharegpt-requests.json (FlashInfer from an earlier call)
    layout
    python3 -P -c 'import sys; sys.path.append("."); from pathlib import Path; from bench.decode_engine import LLAMA3_8B, model_dir; model_dir(LLAMA3_8B, Path("/tmp/llama-8b-shape"))'
    load=(--requests "$PWD/.whl/sharegpt-requests.json" --rates "${SERVE_RATES:-2,4,8,16,inf}" --duration 10 --num-inf 200)
    python3 -P bench/serve_load.py --in-process /tmp/llama-8b-shape/llama-shape "${load[@]}" --out "$OUT/serve-engine.json"
    export RAY_USAGE_STATS_ENABLED=0
    (cd /tmp && exec python3 -m fusedserve.cli run "$OLDPWD/bench/llama-8b-shape.yaml") > "$OUT/fusedserve-run.log" 2>&1 &
    run_pid=$!
    for _ in $(seq 240); do
      python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8123/v1/models", timeout=2)' \
        2>/dev/null && break
      kill -0 $run_pid 2>/dev/null || { tail -30 "$OUT/fusedserve-run.log" >&2; exit 1; }
      sleep 1
    done
    python3 -P bench/serve_load.py --url http://127.0.0.1:8123 --model llama-8b-shape "${load[@]}" --out "$OUT/serve-http.json"
    kill -INT $run_pid; wait $run_pid || true
    ;;
  tests)  # the -m gpu suite against the laid-out package (the checkout's fusedserve/ would hide it: run from /tmp);
          # only the modules that hold -m gpu tests (the others import the HTTP / kopf / helm stack, absent there:
          # collecting them only gave errors, and with -x stopped the run before any test)
    layout
    repo=$PWD
    mapfile -t gpu_modules < <(grep -l "pytest.mark.gpu" "$repo"/tests/test_*.py)
    (cd /tmp && python3 -P -m pytest -m gpu "${gpu_modules[@]}" -q -p no:cacheprovider --rootdir="$repo" -o addopts="" \
      --continue-on-collection-errors --junitxml="$OUT/gpu-tests.xml" "$@")
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
