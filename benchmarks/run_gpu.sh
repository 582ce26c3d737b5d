#!/usr/bin/env bash
# The one GPU runner: every benchmark, check and quality pipeline of benchmarks/ as a named stage.
#
#   STAGES="tests attention" bash benchmarks/run_gpu.sh         # device machine, repo root (carry [".whl", ".gpu"])
#   STAGES=prepare bash benchmarks/run_gpu.sh                    # CPU machine, once: builds .gpu/ (below)
#
# A call runs the stages of STAGES in order. Each one runs under `timeout` with its budget (T_<STAGE> s, e.g.
# T_ATTENTION=200, T_PROFILE_DECODE=120; defaults in BUDGET below), capped by what is left before DEADLINE (s after
# the start, default 570: one device command may run 600 s). A stage that fails or is cut is logged and the next
# one runs. Stage commands are in the stage_* functions below, one per stage, written out in full.
#
# Shared setup, once per call: grain's wheels from .whl/ (the training stack imports grain) when grain is missing;
# PYTHONPATH=. (no install needed); one persistent compilation cache for every process of the call
# (JAX_COMPILATION_CACHE_DIR, default /tmp/fox_jax_cache: a later stage or a warm-up pass reuses the programs).
# .gpu/ (ignored by git; carried to the device) is written by STAGES=prepare on the CPU machine:
#   .gpu/data/        train_tok/ (the first TRAIN_MB MB of the Gutenberg shards pre-tokenized with GPT-2 BPE,
#                     python -m fox_jax.train.data), val.txt (VAL_MB MB of corpus_val: passkey haystack), tok/
#                     (GPT-2 vocab + merges), long/ (four novels: FoX at 2k-16k), eval/ (zero-shot sets; only
#                     with PREPARE_EVAL=1, for QUALITY=dcp's zeroshot stage: the carry limit is 64 MiB)
#   .gpu/fox_triton/  the official FoX Triton kernel (benchmark-only copy; bench_attention.py --fox-triton)
#   .gpu/prev/        with PREV_REV=<commit>: that commit's fox_jax kernels train benchmarks (for PREV=.gpu/prev)
# About 34 MB for TRAIN_MB=40; the carry limit is 64 MiB with the wheels.
#
# Outputs, in $OUT (default /tmp/out; the device tool returns at most 8 files, 2 folders deep):
#   <stage>.json        the stage's main JSON (with PREV: also <stage>_prev.json)
#   timeline.log        start, environment, one line per stage (budget, seconds, rc)
#   run.tar.gz          everything: <stage>.log (the stage's stdout + stderr) and <stage>/ (its other files)
# rewritten after every stage, so a cut call still returns what finished. JSON files beyond 6 stay in the tarball.
#
# PREV=DIR (an earlier tree, e.g. .gpu/prev): the stages attention, dcp, train, profile, decode and e2e also run there, in
# the same call on the same machine, writing <stage>_prev.json next to <stage>.json: a change keeps the speed.
set -uo pipefail
ROOT=$PWD
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); W=$OUT/work; mkdir -p "$W"
GPU=${GPU_DIR:-$ROOT/.gpu}
STAGES=${STAGES:-"tests attention"}
DEADLINE=${DEADLINE:-570}
PREV=${PREV:-}
declare -A BUDGET=(
  [prepare]=900 [tests]=300 [mosaic-ab]=330 [attention]=330 [sweep]=120 [dcp]=140 [gates]=240 [train]=540 [scaling]=560 [profile]=400
  [decode]=560 [decode-blocks]=560 [decode-attention]=240 [profile-decode]=240 [decode-flags]=560 [determinism]=150 [window]=200 [e2e]=400 [quality]=560
  [tables]=30)

# ------------------------------------------------------------------------------------------------- settings
# attention / sweep (bench_attention.py): the anchor shapes + the 760M layer; every implementation side by side
SHAPES=${SHAPES:-4x4096x32x64,8x2048x16x128,2x8192x16x128,1x16384x16x128,1x16384x24x64}
IMPLS=${IMPLS:-cudnn,torch-cudnn,pallas,mosaic,mosaic-triton-bwd,fox-triton,fla,pallas-acp,mosaic-acp,fox-triton-acp}
SWEEP=${SWEEP:-64x128x3x64x64x2,64x128x3x64x64x3,64x128x3x128x64x2,64x128x3x0x64x2}
SWEEP_SHAPES=${SWEEP_SHAPES:-1x16384x24x64,1x16384x16x128}
# mosaic-ab (checks/mosaic_ab.py): kernel variants side by side with the kernels as they are
MOSAIC_AB_MODES=${MOSAIC_AB_MODES:-"dense acp"}; MOSAIC_AB_SHAPES=${MOSAIC_AB_SHAPES:-1x16384x16x128,1x16384x24x64}
MOSAIC_AB_VARIANTS=${MOSAIC_AB_VARIANTS:-fused_dq,fused_dq_3stages}
# dcp (bench_dcp.py)
DCP_SHAPES=${DCP_SHAPES:-8x1024x12x64,4x2048x16x128,1x8192x16x128}; DCP_ARGS=${DCP_ARGS:---no-xla --all-masked}
# train / scaling (bench_train.py); ~45-130 s per compile: split TRAIN_CONFIGS over calls
TRAIN_CONFIGS=${TRAIN_CONFIGS:-"fox-pro:760M:16384 fox-pro:760M:2048 fox-llama:760M:16384 transformer-pro:760M:16384"}
TRAIN_OVERRIDES=${TRAIN_OVERRIDES:-}   # ModelConfig KEY=VALUE,..., e.g. attention_impl=pallas (the Triton kernels)
TRAIN_ACP=${TRAIN_ACP:-both}           # off | on | both (bench_train.py --acp)
TRAIN_TOKENS=${TRAIN_TOKENS:-16384}    # tokens per step (bench_train.py --batch-tokens; 65536 for the 125M rows)
TRAIN_PARAMS_FROM=${TRAIN_PARAMS_FROM:-} # a run directory: every config starts from its parameters (trained gates)
# gates: a short real-data run of GATES_CONFIG (arch:size:seq_len) whose parameters the train stage then starts
# from (ACP on trained forget gates, issue 22): STAGES="gates train" TRAIN_CONFIGS=<the same config>
GATES_CONFIG=${GATES_CONFIG:-fox-pro:760M:16384}; GATES_STEPS=${GATES_STEPS:-200}
# scaling (bench_scaling.py): weak scaling against one device in the same call; 4 GPUs (nvidia-h200-x4) by default,
# MESHES="data=2 fsdp=2" on 2; SCALING_ACP off | on | both; rows merge into $OUT/scaling_h200.json (start from
# SCALING_ROWS, carried along, to grow one file over calls)
SCALING_CONFIGS=${SCALING_CONFIGS-"fox-pro:760M:16384 fox-pro:125M:2048 gpt2-dcp:124M:1024"}  # gpt2-dcp: the DCP fine-tune step
# generation rows of the scaling stage (bench_scaling.py --generate; "" for none): 8 rows per device, dense and acp,
# rows over all devices (data=N)
SCALING_GENERATE=${SCALING_GENERATE-"fox-pro:125M:8192 gpt2:896"}
MESHES=${MESHES:-"data=4 fsdp=4 data=2,fsdp=2 fsdp=2,tensor=2"}; SCALING_ACP=${SCALING_ACP:-both}
# profile (profile_step.py): each variant = ModelConfig overrides
PROFILE_CONFIGS=${PROFILE_CONFIGS:-fox-pro:760M:16384}
PROFILE_VARIANTS=${PROFILE_VARIANTS:-"triton:attention_impl=pallas,vocab_pad_multiple=1,loss_impl=logits \
mosaic:attention_impl=mosaic,vocab_pad_multiple=1,loss_impl=logits \
mosaic-pad-chunked:attention_impl=mosaic,vocab_pad_multiple=128,loss_impl=chunked"}
# decode / profile-decode (bench_decode.py, profile_decode.py): random-init models, speed and KV memory only
DECODE_POLICIES=${DECODE_POLICIES:-dense,dcp,window:256,sinks:4+252}
FOX_DECODE_POLICIES=${FOX_DECODE_POLICIES:-dense,acp,window:256,sinks:4+252}
DECODE_BUDGET=${DECODE_BUDGET-4}       # GiB of allocated KV in the budget mode ("": equal batch only)
# tests: the GPU tests (pytest -m gpu; TEST_K: a -k selection)
TEST_FILES=${TEST_FILES:-"tests/test_pallas.py tests/test_mosaic.py tests/test_dcp_pallas.py"}
TEST_K=${TEST_K:-}
# e2e: the training commands end to end (tokens/s from their metrics.jsonl)
E2E_STEPS=${E2E_STEPS:-30}

# ------------------------------------------------------------------------------------------------- helpers
elapsed() { echo $(( $(date +%s) - T0 )); }
stamp() { printf '[%4ss %s] %s\n' "$(elapsed)" "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/timeline.log"; }
STAGE_END=0
t() {  # t CMD...: CMD under the time left in the current stage
  local left=$(( STAGE_END - $(elapsed) ))
  [ "$left" -ge 5 ] || { echo "no time left in the stage for: $*"; return 124; }
  timeout -k 10 "$left" "$@"; }
each_tree() {  # each_tree CMD...: CMD in this tree and, with PREV, in $PREV first; "{tag}" in CMD -> "" / "_prev"
  local tree tag a args rc=0
  for tree in ${PREV:+"$PREV"} "$ROOT"; do
    [ "$tree" = "$ROOT" ] && tag= || tag=_prev
    args=(); for a in "$@"; do args+=("${a//\{tag\}/$tag}"); done
    echo "== ${tree}: ${args[*]}"
    (cd "$tree" && PYTHONPATH=$PWD${WHEELS:+:$WHEELS} "${args[@]}") || rc=$?
  done; return $rc; }
pack() {  # $OUT: run.tar.gz (work/), timeline.log and at most 6 JSON files (the others are in the tarball)
  local j
  for j in $(ls -t "$OUT"/*.json 2>/dev/null | tail -n +7); do mv "$j" "$W/"; done
  tar -czf "$OUT/run.tar.gz.tmp" -C "$W" . && mv "$OUT/run.tar.gz.tmp" "$OUT/run.tar.gz"; }

# ------------------------------------------------------------------------------------------------- stages
stage_prepare() {  # CPU machine, repo root: .gpu/ for the device (SHARED: the shared data folder)
  local shared=${SHARED:-$ROOT/../shared}; [ -d "$shared" ] || shared=/work/shared
  local d=$GPU/data stage; stage=$(mktemp -d)
  mkdir -p "$d/long" "$d/tok" "$GPU/fox_triton"
  cp "$shared"/data/tokenizers/gpt2/vocab.json "$shared"/data/tokenizers/gpt2/merges.txt "$d/tok/"
  cp "$shared"/data/long/*.txt "$d/long/"
  # the zero-shot sets (7 MB) only with PREPARE_EVAL=1: the tree, .gpu and .whl must fit run's 64 MiB carry
  rm -rf "$d/eval"; [ "${PREPARE_EVAL:-0}" = 1 ] && cp -r "$shared/data/eval" "$d/eval"
  head -c $(( ${VAL_MB:-1} * 1000000 )) "$shared"/data/corpus_val/gutenberg_val.txt > "$d/val.txt"
  (set +o pipefail; cat "$shared"/data/corpus/gutenberg_train_0*.txt | head -c $(( ${TRAIN_MB:-40} * 1000000 )) \
    > "$stage/train.txt")
  rm -rf "$d/train_tok"
  python3 -m fox_jax.train.data "$d/train_tok" --data "$stage/train.txt" --val-data "$shared/data/corpus_val" \
    --tokenizer "$d/tok"; rm -rf "$stage"
  cp "$shared"/anchors/fox_triton/forgetting_attention.py "$shared"/anchors/fox_triton/LICENSE "$GPU/fox_triton/"
  if [ -n "${PREV_REV:-}" ]; then
    rm -rf "$GPU/prev"; mkdir -p "$GPU/prev"
    git archive "$PREV_REV" fox_jax kernels train benchmarks | tar -x -C "$GPU/prev"
  fi
  du -sh "$d"/* "$GPU"/fox_triton "$GPU"/prev .whl 2>/dev/null; true; }
stage_tests() {  # the GPU tests: dense float32 oracles, outputs and gradients (Pallas/Triton, Mosaic, DCP kernels);
  # TEST_K: a pytest -k selection (the whole of tests/test_mosaic.py takes more than 560 s on an H100: 17 of its 21 GPU tests
  # passed in 561 s on 2026-12-07); -v names each test as it ends, so a cut stage says where it was
  t python3 -m pytest -v -m gpu $TEST_FILES ${TEST_K:+-k "$TEST_K"} -rf --durations=0 -p no:cacheprovider; }
stage_attention() {  # forgetting attention side by side: cuDNN (jax, torch), ours (Triton, Mosaic), official FoX, fla
  local fox=; [ -d "$GPU/fox_triton" ] && fox="--fox-triton $GPU/fox_triton"
  each_tree t python3 benchmarks/bench_attention.py --impls "$IMPLS" --shapes "$SHAPES" $fox \
    --out "$OUT/attention{tag}.json"; }
stage_sweep() {  # Mosaic tilings (BQxBKxSTAGES forward x BBQxBBKxBSTAGES backward; SWEEP_ACP off|on|both)
  t python3 benchmarks/bench_attention.py --mosaic-sweep "$SWEEP" --shapes "$SWEEP_SHAPES" --impls "" \
    --sweep-acp "${SWEEP_ACP:-off}" --out "$OUT/sweep.json"; }
stage_mosaic_ab() {  # Mosaic kernel variants against the kernels as they are (checks/mosaic_ab.py), one process per
  # (shape, dense/ACP), so a cut stage keeps what finished: MOSAIC_AB_MODES "dense acp", MOSAIC_AB_SHAPES, MOSAIC_AB_VARIANTS
  local mode shape rc=0
  for mode in $MOSAIC_AB_MODES; do
    for shape in ${MOSAIC_AB_SHAPES//,/ }; do
      t python3 benchmarks/checks/mosaic_ab.py $([ "$mode" = dense ] && echo --dense) --shapes "$shape" \
        --variants "$MOSAIC_AB_VARIANTS" --out "$OUT/mosaic_ab_${mode}_${shape}.json" || rc=$?
    done
  done; return $rc; }
stage_dcp() {  # DCP attention: the Pallas kernels (live-tile lists) vs dense Pallas at 50% / 90% of pairs dropped
  each_tree t python3 benchmarks/bench_dcp.py $DCP_ARGS --shapes "$DCP_SHAPES" --sparsities 0.5,0.9 \
    --out "$OUT/dcp{tag}.json"; }
stage_gates() {  # needs .gpu/data/train_tok (STAGES=prepare on the CPU) and grain; sets TRAIN_PARAMS_FROM
  local arch size seq; IFS=: read -r arch size seq <<< "$GATES_CONFIG"
  rm -rf /tmp/gates_run
  t python3 -m fox_jax.train.cli train --preset "$size" --arch "$arch" --seq-len "$seq" --batch-size 1 \
    --steps "$GATES_STEPS" --data "$GPU/data/train_tok" --tokenizer "$GPU/data/train_tok/tokenizer" \
    --workdir /tmp/gates_run --ckpt-every "$GATES_STEPS" --eval-every 0 --log-every 50 --no-progress \
    --dtype bfloat16 && TRAIN_PARAMS_FROM=/tmp/gates_run; }
stage_train() {  # the training table: one row per (config, ACP off/auto), TRAIN_TOKENS per step
  each_tree t python3 benchmarks/bench_train.py --configs $TRAIN_CONFIGS --acp "$TRAIN_ACP" --batch-tokens "$TRAIN_TOKENS" \
    --steps 5 --warmup 1 --overrides "$TRAIN_OVERRIDES" ${TRAIN_PARAMS_FROM:+--params-from "$TRAIN_PARAMS_FROM"} \
    --out "$OUT/train{tag}.json"; }
stage_tables() {  # issue 22's two tables from this call's attention / dcp / train JSON: attention_<gpu>.json,
  # train_<gpu>.json, speed_<gpu>.md in $OUT (merge into benchmarks/results/speed/ on the CPU with --merge)
  local a=()
  [ -f "$OUT/attention.json" ] && a+=(--attention "$OUT/attention.json")
  [ -f "$OUT/dcp.json" ] && a+=(--dcp "$OUT/dcp.json")
  [ -f "$OUT/train.json" ] && a+=(--train "$OUT/train.json")
  t python3 benchmarks/plots/speed_tables.py "${a[@]}" --out-dir "$OUT"; }
stage_scaling() {  # weak scaling (nvidia-h200-x4): each config on one GPU, then on every mesh of MESHES over all
  # GPUs, 16k tokens per GPU and step; efficiency against the one-GPU row of the same call
  local rows=$OUT/scaling_h200.json
  cp "${SCALING_ROWS:-benchmarks/results/scaling/scaling_h200.json}" "$rows" 2>/dev/null; chmod u+w "$rows" 2>/dev/null
  # shellcheck disable=SC2086
  t python3 benchmarks/bench_scaling.py --configs $SCALING_CONFIGS --meshes $MESHES --acp "$SCALING_ACP" \
    --generate $SCALING_GENERATE \
    --tokens-per-device 16384 --steps 5 --warmup 1 --merge --out "$rows"; }
stage_profile() {  # where a training step's device time goes, per kernel category, variants side by side
  each_tree t python3 benchmarks/profile_step.py --configs $PROFILE_CONFIGS --batch-tokens 16384 --steps 3 --warmup 2 --top 60 \
    --variants $PROFILE_VARIANTS --out "$OUT/profile{tag}.json"; }
stage_decode() {  # issue 20's table, one DECODE_PART per call (~9 compiles of 35-60 s each; rows merge into one file):
  # gpt2 (B32, 896 + 128, every policy + HF static/dynamic cache) | fox:<prompt> (FoX (Pro) 125M, B8, prompt + 128)
  # equal batch (with the kernels' time per step from a trace: --device-times) and a DECODE_BUDGET GiB KV budget;
  # rows go to one file per card, decode_<card>.json (h100, h200:
  # from nvidia-smi): DECODE_ROWS (default results/decode/decode_<card>.json, carried along) collects the rows of
  # every part and call on that card; $OUT/decode_<card>.json is the merged file to commit back.
  local card part rc=0 rows
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -io 'h[0-9]00' | tr A-Z a-z)
  rows=$OUT/decode_${card:-gpu}.json
  cp "${DECODE_ROWS:-benchmarks/results/decode/decode_${card:-gpu}.json}" "$rows" 2>/dev/null; chmod u+w "$rows" 2>/dev/null
  for part in ${DECODE_PART:-gpt2}; do
    case $part in
      gpt2) t python3 benchmarks/bench_decode.py --model gpt2 --model-name gpt2-124M --policies "$DECODE_POLICIES" \
              --prompt-lengths 896 --new-tokens 128 --equal-batch 32 ${DECODE_BUDGET:+--kv-budget "$DECODE_BUDGET"} --hf --device-times \
              --out "$W/decode/decode_gpt2.json" --rows-out "$rows" || rc=$? ;;
      fox:*) t python3 benchmarks/bench_decode.py --model fox-pro:125M --model-name fox-pro-125M \
              --policies "$FOX_DECODE_POLICIES" --prompt-lengths "${part#fox:}" --new-tokens 128 --equal-batch 8 \
              ${DECODE_BUDGET:+--kv-budget "$DECODE_BUDGET"} --device-times --out "$W/decode/decode_fox_${part#fox:}.json" \
              --rows-out "$rows" || rc=$? ;;
      *) echo "unknown DECODE_PART '$part' (gpt2 | fox:<prompt length>)"; rc=2 ;;
    esac
  done; return $rc; }
stage_decode_blocks() {  # generate's decode blocks (steps_per_check K) against K = 1, equal batch, one process per
  # (part, K): BLOCK_PARTS fox (FoX (Pro) 125M B8 8192 + 128, FOX_BLOCK_POLICIES) | gpt2 (B32 896 + 128, dense);
  # BLOCK_KS (default "8 1"); rows in $OUT/decode_blocks_<part>_k<K>.json
  local part k args rc=0
  for part in ${BLOCK_PARTS:-fox gpt2}; do
    case $part in
      fox) args="--model fox-pro:125M --model-name fox-pro-125M --prompt-lengths 8192 --equal-batch 8
                 --policies ${FOX_BLOCK_POLICIES:-dense,acp,window:256}" ;;
      gpt2) args="--model gpt2 --model-name gpt2-124M --prompt-lengths 896 --equal-batch 32 --policies dense" ;;
      *) echo "unknown BLOCK_PARTS entry '$part' (fox | gpt2)"; rc=2; continue ;;
    esac
    for k in ${BLOCK_KS:-8 1}; do
      # shellcheck disable=SC2086
      t python3 benchmarks/bench_decode.py $args --new-tokens 128 --steps-per-check "$k" \
        --out "$W/decode-blocks/${part}_k$k.json" --rows-out "$OUT/decode_blocks_${part}_k$k.json" || rc=$?
    done
  done; return $rc; }
stage_decode_attention() {  # the decode attention op alone: xla / Pallas kernel / cuDNN, tiling sweep, GPU tests
  t python3 -m pytest tests/test_decode_attention.py -m "gpu or not gpu" -q -n 0 -p no:cacheprovider
  t python3 benchmarks/bench_decode_attention.py --sweep --out "$OUT/decode_attention.json"; }
stage_profile_decode() {  # where a decode step's device time goes (N and 1 new tokens, one program); loop check
  t python3 benchmarks/checks/check_decode_loop.py
  t python3 benchmarks/profile_decode.py --model ${PROFILE_DECODE_MODEL:-gpt2} --batch ${PROFILE_DECODE_BATCH:-32} \
    --prompt ${PROFILE_DECODE_PROMPT:-896} --new-tokens 128 --slots 256 \
    --policies ${PROFILE_DECODE_POLICIES:-dense,window:256} --out "$OUT/profile_decode.json"; }
stage_decode_flags() {  # the decode step under XLA flag sets (one process each: XLA reads its flags once), same
  # programs side by side: FLAG_SETS "name|flags" lines x FLAG_MODELS (fox: FoX (Pro) 125M B8, 2048 + 64, acp in a
  # 256-slot pool; gpt2: B32, 896 + 64, dense; quick: CPU smoke); each run under T_FLAG_RUN s (150; T_FLAG_RUN_EXH,
  # 420, for the exhaustive tiling search); FLAG_ARGS: more profile_decode.py arguments for every run (e.g.
  # "--prefill-chunk 16": the prefill's GEMMs small, so an exhaustive search tunes mostly the decode step's); writes
  # $OUT/decode_flags/<name>_<model>.json (profile_decode.py's rows: ms/step, kernels/step, compile s)
  local sets=${FLAG_SETS:-"base|
pdl|--xla_gpu_enable_pdl=true
nocb|--xla_gpu_enable_command_buffer=
at0|--xla_gpu_autotune_level=0
exh|--xla_gpu_exhaustive_tiling_search=true"} name flags model args all limit
  mkdir -p "$OUT/decode_flags"
  while IFS='|' read -r name flags; do
    [ -n "$name" ] || continue
    for model in ${FLAG_MODELS:-fox gpt2}; do
      case $model in
        fox) args="--model fox-pro:125M --batch 8 --prompt 2048 --slots 256 --policies acp" ;;
        gpt2) args="--model gpt2 --batch 32 --prompt 896 --policies dense" ;;
        quick) args="--quick" ;;   # CPU smoke run of the stage
        *) echo "unknown FLAG_MODELS entry '$model' (fox | gpt2 | quick)"; continue ;;
      esac
      all="${XLA_FLAGS:-}${XLA_FLAGS:+${flags:+ }}$flags"
      # a set that changes GEMM autotuning (its level, the tiling search, the candidate list) must not read a shared
      # per-fusion autotune cache, whose entries are keyed by the fusion and the device, not by these flags: neither
      # the call's (AUTOTUNE_DIR) nor the one JAX itself points XLA at inside the persistent compilation cache
      # (jax_persistent_cache_enable_xla_caches; until 2026-12-07 it served every set the first set's tiles)
      local env_extra=
      case $flags in *autotun*|*tiling*)
        all=$(sed -E 's/--xla_gpu_per_fusion_autotune_cache_dir=[^ ]*//' <<< "$all")
        env_extra="JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=none" ;; esac
      # the exhaustive search compiles the FoX program in > 150 s on an H100 (2026-12-07; the default: 24 s)
      case $flags in *exhaustive*) limit=${T_FLAG_RUN_EXH:-420} ;; *) limit=${T_FLAG_RUN:-150} ;; esac
      echo "== $name $model: XLA_FLAGS=$all"
      # shellcheck disable=SC2086
      env ${all:+XLA_FLAGS="$all"} $env_extra timeout -k 5 "$limit" python3 benchmarks/profile_decode.py $args \
        --new-tokens 64 --repeats 3 --top 40 ${FLAG_ARGS:-} --out "$OUT/decode_flags/${name}_$model.json" | grep "^== "
    done
  done <<< "$sets"; }
stage_determinism() {  # the Pallas kernels twice on identical inputs, bit for bit (race detector)
  t python3 benchmarks/checks/check_determinism.py --shape 1x16384x16x128 --repeats 3; }
stage_window() {  # the sliding window on the GPU: Triton kernels vs the float32 reference, and its speed
  t python3 benchmarks/checks/check_window_gpu.py; }
stage_e2e() {  # the training commands end to end: pretrain-gpt2, then finetune-dcp of it; median tokens/s
  local d=$GPU/data
  each_tree t bash -c '
    set -e; W=/tmp/e2e{tag}; rm -rf "$W"
    python3 -m fox_jax.train.cli pretrain-gpt2 --workdir "$W/pre" --data "$0/train_tok" --tokenizer "$0/train_tok/tokenizer" \
      --seq-len 1024 --batch-size 8 --steps "$1" --dtype bfloat16 --eval-every 0 --eval-batches 2 --ckpt-every 0 \
      --log-every 1 --no-progress
    python3 -m fox_jax.train.cli finetune-dcp --hf-gpt2 "$W/pre/hf" --workdir "$W/dcp" --data "$0/train_tok" \
      --batch-size 8 --steps "$1" --dtype bfloat16 --eval-every 0 --eval-batches 2 --ckpt-every 0 --log-every 1 \
      --no-progress
    python3 - "$W" "$2" <<\PY
import json, statistics, sys
rows = {}
for run in ("pre", "dcp"):  # the first two steps compile
    rates = [r["tokens_per_sec"] for r in map(json.loads, open(f"{sys.argv[1]}/{run}/metrics.jsonl")) if "tokens_per_sec" in r][2:]
    rows[run] = {"steps": len(rates), "median_tokens_per_sec": statistics.median(rates) if rates else None}
json.dump(rows, open(sys.argv[2], "w"), indent=1); print(json.dumps(rows))
PY' "$d" "$E2E_STEPS" "$OUT/e2e{tag}.json"; }
stage_quality() {  # models trained and scored: QUALITY=inference (default) | dcp | archs | table (benchmarks/quality.sh)
  t env DEADLINE=$(( STAGE_END - $(elapsed) - 15 )) R="$W/quality" bash benchmarks/quality.sh
  local rc=$?
  local j  # the plan's main JSON: inference summary, or the dcp-eval tables
  for j in "$W/quality/quality_rows.json" "$W/quality/summary.json" "$W/quality/dcp_eval/dcp_eval.json"; do
    [ -f "$j" ] && cp "$j" "$OUT/quality.json" && break
  done; return $rc; }

# ------------------------------------------------------------------------------------------------- setup
: > "$OUT/timeline.log"
# the code's identity: the device's copy of .git can predate its tree, so also a hash of the tracked files' contents
# (the same command on the CPU machine, at a commit, names the commit that matches)
tree_hash() { git ls-files -z 2>/dev/null | xargs -0 cat 2>/dev/null | sha1sum | cut -c1-12; }
stamp "start: STAGES=\"$STAGES\" OUT=$OUT DEADLINE=${DEADLINE}s${PREV:+ PREV=$PREV} HEAD $(git rev-parse --short HEAD 2>/dev/null), tree $(tree_hash)"
export PYTHONUNBUFFERED=1
WHEELS=
if [[ " $STAGES " != " prepare " ]] && ! python3 -c "import grain" 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --target /tmp/wheels .whl/*.whl 2>&1 | tail -n 2; WHEELS=/tmp/wheels
fi
export PYTHONPATH=$ROOT${WHEELS:+:$WHEELS}
if [[ " $STAGES " != " prepare " ]] && ! grain_err=$(python3 -c "import grain.python" 2>&1); then  # say so once, up front
  stamp "grain does not import (the training stack needs it; benchmarks/README.md lists the wheels for .whl/): $(tail -n 1 <<< "$grain_err")"
fi
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/fox_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}
# XLA's GEMM autotuning results per fusion, shared by every process of the call and kept for the next call:
# AUTOTUNE_DIR (default .gpu/autotune: carried along when it exists) is copied into run.tar.gz (autotune/); unpack it
# to .gpu/autotune and carry .gpu to skip the autotuning of programs compiled before (decode compiles 35-60 s).
AUTOTUNE_DIR=${AUTOTUNE_DIR:-$GPU/autotune}
if [[ " $STAGES " != " prepare " ]] && mkdir -p "$AUTOTUNE_DIR" 2>/dev/null && XLA_FLAGS="${XLA_FLAGS:-} \
    --xla_gpu_per_fusion_autotune_cache_dir=$AUTOTUNE_DIR" python3 -c "import jax; jax.numpy.ones(1).block_until_ready()" \
    > /dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$AUTOTUNE_DIR"
else
  AUTOTUNE_DIR=
fi
if [[ " $STAGES " != " prepare " ]]; then
  stamp "gpu: $(nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader 2>/dev/null | paste -sd';')"
  stamp "$(python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -n 1)"
fi

# ------------------------------------------------------------------------------------------------- run
for s in $STAGES; do
  var=T_$(echo "$s" | tr 'a-z-' 'A-Z_'); budget=${!var:-${BUDGET[$s]:-}}
  if [ -z "$budget" ]; then stamp "unknown stage '$s' (stages: ${!BUDGET[*]})"; continue; fi
  left=$(( DEADLINE - $(elapsed) ))
  [ "$s" = prepare ] && left=$budget   # CPU, no device limit
  [ "$left" -lt "$budget" ] && budget=$left
  if [ "$budget" -lt 10 ]; then stamp "skip $s: ${budget}s left"; continue; fi
  STAGE_END=$(( $(elapsed) + budget )); start=$(elapsed); mkdir -p "$W/$s"
  stamp "begin $s (budget ${budget}s)"
  "stage_${s//-/_}" > "$W/$s.log" 2>&1; rc=$?
  grep -v -i -e deprecat -e "^\s*warnings.warn" "$W/$s.log" | tail -n "${TAIL:-30}"
  stamp "end   $s rc=$rc after $(( $(elapsed) - start ))s"
  rmdir "$W/$s" 2>/dev/null; pack
done
cp "$OUT/timeline.log" "$W/"; [ -n "$AUTOTUNE_DIR" ] && cp -r "$AUTOTUNE_DIR" "$W/autotune"; pack; rm -rf "$W"
ls -la "$OUT"
