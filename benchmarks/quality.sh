#!/usr/bin/env bash
# The quality stage of benchmarks/run_gpu.sh (STAGES=quality): models trained and scored with the project's own
# commands (fox-jax train / finetune-dcp / eval --cache / passkey / dcp-eval / zeroshot, bench_decode.py on the
# trained models), in one device command. Three plans (QUALITY=...), each a list of steps (PLAN) run in order:
#
# QUALITY=inference (default): pruned inference, the table of docs/inference.md
#   fox_train    FoX (Pro), reduced shape, at 2048 context, FOX_STEPS steps
#   fox_quality  eval --cache POLICY on the long novels at FOX_CONTEXTS (2k-16k; ppl under the policy and dense on
#                the same documents) and passkey --cache POLICY, for the policies FOX_POLICIES; a warm-up pass of
#                the FoX decode benchmarks (compiles into the persistent compilation cache)
#   bench_fox    benchmarks/bench_decode.py at equal batch and under a KV budget, alone on the GPU
#   pretrain     GPT-2 124M shape (fox-jax train --preset gpt2, seq 1024) on Gutenberg, STEPS steps
#   finetune     from its last checkpoint, FT_STEPS steps each: DCP at each γ of GAMMAS (finetune-dcp --from-run),
#                a fixed local:WINDOW pattern and a dense control (FT_FORKS: the pretraining run continued, its
#                config forked with model.sparse_pattern / without, lr FT_LR constant, no weight decay)
#   gpt2_quality eval --cache / passkey --cache for every GPT-2 model, JOBS at a time, and the benchmarks' warm-up
#   bench_gpt2   bench_decode.py on the GPT-2 models (BENCH_MODELS)
#   then summary.json + summary.md + inference.png (benchmarks/plots/plot_inference.py).
# QUALITY=dcp: Dynamic Context Pruning, the table of docs/dcp.md (was run_gpu_dcp.sh)
#   pretrain (8 x 512 GPT-2 shape, 1000 steps of 32 x 1024) -> finetune (DCP at γ 0.1 / 0.3 / 1.0, 200 steps of
#   8 x 1024) -> dcp_eval (fox-jax dcp-eval: ppl vs sparsity against local / strided baselines at matched
#   sparsity, drop plots, context switch) -> zeroshot (fox-jax zeroshot, dense and the middle γ; EVAL_DIR)
# QUALITY=table: the quality table of issue 21 (docs/results.md), one row per method, in stages that each retrain
#   what they need (nothing survives a device call): pretrain (GPT-2 124M, STEPS x PRE_BATCH x SEQ) ->
#   table_finetune (TABLE_RUNS, FT_STEPS each from the pretrained checkpoint: dcp:<γ> = finetune-dcp, dense = the
#   dense fine-tuning control, local:W / strided:S / sinks:S+W = the run continued with that fixed pattern, same
#   lr and steps) -> table_eval (fox-jax dcp-eval on one set of validation windows: every model under its own
#   mask, the untuned baselines at the DCP sparsities; fox-jax passkey under the cache policy that decodes each
#   mask; benchmarks/plots/plot_quality.py -> quality_rows.json (rows of quality_h200.json), quality.png/md).
#   TABLE_STAGE names the rows' stage; e.g. TABLE_RUNS="dcp:0.04 dcp:0.1 dcp:0.25 dcp:0.6 dense" (stage gpt2-dcp),
#   then the fixed patterns at the DCP runs' sparsities (stage gpt2-fixed): TABLE_MATCH=<that call's
#   table/dcp_eval.json> sets TABLE_RUNS to the TABLE_MATCH_KINDS (default "local strided sinks") patterns matched
#   (match_sparse_pattern) to each DCP run of TABLE_MATCH_RUNS (labels, default all), plus the dense control.
#   A fixed pattern at several sizes is several items (TABLE_RUNS="... local:301 local:168 local:54 strided:300 ...";
#   match_sparse_pattern(kind, target, SEQ) gives the size of a target sparsity). TABLE_PARALLEL=1 starts every
#   fine-tune at once (each with 0.9 / n of the GPU's memory: their start-up and compiles overlap).
#   PASSKEY_LENGTHS= (empty) skips the passkey runs (every GPT-2 model so far, dense included, scored 0%).
#   The FoX rows come from QUALITY=inference PLAN="fox_train fox_quality" (collect: plot_quality.py on its
#   summary.json, model FOX_ARCH-FOX_PRESET, stage FOX_ARCH).
# QUALITY=archs: models of several architectures on the same batches, the first experiment of docs/results.md
#   (was run_gpu_experiment.sh / run_gpu_train.sh)
#   archs        fox-jax train for each run of ARCH_RUNS (NAME = an --arch, NAME-acp = that arch with
#                model.adaptive_threshold=auto; ARCH_SHAPE, ARCH_STEPS x ARCH_BATCH x ARCH_SEQ, data seed 0), each
#                under ARCH_RUN_LIMIT s, then fox-jax eval (per-position loss); ARCH_GPUS > 1 spreads the runs over
#                that many GPUs; then bench_attention.py --gates-from the fox-pro run and plot_experiment.py.
#                The 125M FoX (LLaMA) run of docs/results.md: ARCH_RUNS=fox-llama ARCH_SHAPE= ARCH_STEPS=800.
# Every step runs under `timeout` with its budget (T_*), capped by what is left before DEADLINE (s after the start;
# the runner passes its stage budget); a step that fails or is cut is logged (timeline.log, stages.jsonl,
# jobs.jsonl) and the rest runs. Inference budgets (s): setup ~10, fox_train 110, fox_quality 60, bench_fox 60,
# pretrain 140, finetune 90, gpt2_quality 110, bench_gpt2 60, reserve 12.
#
# Needs the runner's setup (grain importable, PYTHONPATH) and the data folder of `STAGES=prepare` in .gpu/data
# (train_tok/ pre-tokenized, or train.txt + val.txt; tok/; long/; eval/). Writes everything into $R.
#   STAGES=quality bash benchmarks/run_gpu.sh                                  # device machine, repo root
#   QUALITY=dcp STAGES=quality bash benchmarks/run_gpu.sh
#   SMOKE=1 STAGES=quality OUT=/tmp/q DATA_DIR=/tmp/smoke_data bash benchmarks/run_gpu.sh   # CPU: the plumbing
# H200 sizing (results/quality/h200_inference): GPT-2 124M pretraining 229k tokens/s at 8 x 1024, so
# 1400 steps of 16 x 1024 = 22.9M tokens ~ 100 s + ~35 s start/compile/checkpoint; DCP fine-tuning ran at
# 70k tokens/s (xla masks; DCP_IMPL=pallas is the default here, with an xla retry if it fails): 100 steps of
# 16 x 1024 ~ 25 s each. γ: on the 8-layer model of results/quality/h200_dcp, 200 steps of 8 x 1024 at
# γ 0.1 / 0.3 / 1.0 gave 50 / 65 / 95% sparsity -> GAMMAS="0.3 0.6" for ~60-85%. QUALITY=dcp on the H200:
# pretraining 430-510k tokens/s (1000 steps of 32 x 1024 in < 170 s incl. compile), fine-tuning ~105k tokens/s
# (< 70 s per γ), zero-shot < 40 s per model; dcp-eval needs more than 90 s. QUALITY=archs: d 512 x 8 layers,
# 32 x 2048 tokens per step, ~390k tokens/s, 300 steps ~ 50 s plus ~60 s of compilation and evaluations.
set -uo pipefail
ROOT=$PWD
T0=$(date +%s)
R=${R:-${OUT:-/tmp/out}/quality}; mkdir -p "$R"/{logs,runs,quality,passkey,bench}
export PYTHONUNBUFFERED=1
SMOKE=${SMOKE:-0}

# ---------------------------------------------------------------------------------------------- settings
if [ "$SMOKE" = 1 ]; then  # tiny everything (CPU): the plumbing, not the numbers
  : "${GPT2_SHAPE:=model.n_layers=2 model.d_model=64 model.n_heads=2 model.n_positions=128}" "${SEQ:=128}"
  : "${STEPS:=2}" "${PRE_BATCH:=2}" "${FT_STEPS:=2}" "${WINDOW:=32}" "${SINKS:=4}" "${EVAL_BATCHES:=1}"
  : "${FOX_PRESET:=tiny}" "${FOX_SHAPE:=model.n_layers=2 model.d_model=64 model.n_heads=2}" "${FOX_SEQ:=128}"
  : "${FOX_STEPS:=2}" "${FOX_BATCH:=2}" "${FOX_CONTEXTS:=128 256}" "${FOX_PASSKEY_LENGTHS:=128,256}"
  : "${PASSKEY_LENGTHS=64,128}" "${PASSKEY_DEPTHS:=0,1}" "${PASSKEY_N:=1}" "${BENCH_NEW:=8}"
  : "${BENCH_PROMPT:=64}" "${EQ_BATCH:=2}" "${KV_BUDGET:=0.002}" "${MAX_BATCH:=4}" "${REPEATS:=1}"
  : "${FOX_BENCH_PROMPTS:=128 256}" "${FOX_BENCH_BUDGET_PROMPTS:=256}" "${FOX_BENCH_NEW:=8}" "${FOX_EQ_BATCH:=2}"
  : "${FOX_KV_BUDGET:=0.004}" "${FOX_MAX_BATCH:=4}" "${DTYPE:=float32}" "${DCP_IMPL:=xla}" "${JOBS:=2}"
  : "${DEADLINE:=3000}" "${T_PRE:=300}" "${T_FT:=400}" "${T_FOX:=300}" "${T_GQ:=900}" "${T_FQ:=600}"
  : "${T_GB:=300}" "${T_FB:=300}" "${NUM_DOCS:=2}" "${FOX_NUM_DOCS:=2}" "${FOX_EVAL_TOKENS:=512}"
  : "${ARCH_RUNS:=fox-pro fox-pro-acp}" "${ARCH_PRESET:=tiny}" "${ARCH_STEPS:=2}" "${ARCH_SEQ:=128}"
  : "${ARCH_SHAPE:=model.n_layers=2 model.d_model=64 model.n_heads=2}" "${ARCH_BATCH:=2}" "${ARCH_EVAL_DOCS:=2}"
  : "${T_ARCHS:=1800}" "${ARCH_RUN_LIMIT:=900}" "${GATES_ARGS:=--quick}"
  : "${ZS_LIMIT:=4}" "${ZS_TASKS:=piqa}" "${T_DE:=600}" "${T_ZS:=600}" "${DE_BATCHES:=1}"
fi
QUALITY=${QUALITY:-inference}
case $QUALITY in  # the plans' defaults (every one can still be set from outside)
  inference) ;;
  dcp) : "${PLAN:=pretrain finetune dcp_eval zeroshot}" "${FT_FORKS:=}" "${GAMMAS:=0.1 0.3 1.0}"
       : "${GPT2_SHAPE:=model.n_layers=8 model.d_model=512 model.n_heads=8}" "${STEPS:=1000}" "${PRE_BATCH:=32}"
       : "${PRE_LR:=1e-3}" "${PRE_WARMUP:=60}" "${FT_STEPS:=200}" "${FT_BATCH:=8}" "${T_PRE:=200}" "${T_FT:=240}" ;;
  archs) : "${PLAN:=archs}" ;;
  table) : "${PLAN:=pretrain table_finetune table_eval}" "${STEPS:=2000}" "${T_PRE:=170}" "${T_FT:=260}"
         : "${FT_STEPS:=100}" "${FT_FORKS:=}" "${DE_BATCHES:=8}" ;;
  *) echo "QUALITY=$QUALITY: expected inference, dcp, archs or table" >&2; exit 2 ;;
esac
DATA_DIR=${DATA_DIR:-$ROOT/.gpu/data}
if [ -f "$DATA_DIR/train_tok/meta.json" ]; then
  TRAIN_DATA=${TRAIN_DATA:-$DATA_DIR/train_tok}; VAL_ARGS=${VAL_ARGS:-}; TOK=${TOK:-$DATA_DIR/train_tok/tokenizer}
else
  TRAIN_DATA=${TRAIN_DATA:-$DATA_DIR/train.txt}; VAL_ARGS=${VAL_ARGS:---val-data $DATA_DIR/val.txt}; TOK=${TOK:-$DATA_DIR/tok}
fi
LONG=${LONG:-$DATA_DIR/long}; [ -d "$LONG" ] || LONG=$DATA_DIR/val.txt      # FoX long-context evaluation text
HAYSTACK=${HAYSTACK:-$DATA_DIR/val.txt}                                     # passkey filler text
DTYPE=${DTYPE:-bfloat16}
# GPT-2
GPT2_SHAPE=${GPT2_SHAPE:-}; SEQ=${SEQ:-1024}; STEPS=${STEPS:-1400}; PRE_BATCH=${PRE_BATCH:-16}
PRE_LR=${PRE_LR:-6e-4}; PRE_WARMUP=${PRE_WARMUP:-100}
# FT_ILR: the interaction parameters' rate; one rate for all by default, as the paper (results/quality/README.md:
# at 10x, 3e-3, the masks drop about half the pairs with γ = 0 and sparsity no longer follows γ)
FT_STEPS=${FT_STEPS:-100}; FT_BATCH=${FT_BATCH:-$PRE_BATCH}; FT_LR=${FT_LR:-3e-4}; FT_ILR=${FT_ILR:-$FT_LR}
GAMMAS=${GAMMAS:-"0.3 0.6"}
DCP_IMPL=${DCP_IMPL:-pallas}; WINDOW=${WINDOW:-256}; SINKS=${SINKS:-4}
WIN_POLICY=window:$WINDOW; SINK_POLICY=sinks:$SINKS+$((WINDOW - SINKS))
EVAL_BATCHES=${EVAL_BATCHES:-8}; NUM_DOCS=${NUM_DOCS:-16}   # eval --cache: the first SEQ tokens of NUM_DOCS val documents
PASSKEY_LENGTHS=${PASSKEY_LENGTHS-256,512,1024}; PASSKEY_DEPTHS=${PASSKEY_DEPTHS:-0,0.25,0.5,0.75,1}; PASSKEY_N=${PASSKEY_N:-4}
BENCH_NEW=${BENCH_NEW:-128}; BENCH_PROMPT=${BENCH_PROMPT:-$((SEQ - BENCH_NEW))}; EQ_BATCH=${EQ_BATCH:-32}
KV_BUDGET=${KV_BUDGET:-2}; MAX_BATCH=${MAX_BATCH:-256}; REPEATS=${REPEATS:-3}
BENCH_WARM=${BENCH_WARM:-1}   # 1: compile the bench programs during the quality stages (persistent cache)
POOL=${POOL:-head}   # calibrated dcp/acp pools: uniform | layer | head (acp: per key/value head; dcp: per layer)
BENCH_MODELS=${BENCH_MODELS:-"pre dcp"}   # pre, dcp (every DCP model), ftlocal, ftdense; speed of one policy does not
                                          # depend on the weights except for dcp/acp, so the default skips the last two
# FoX (Pro)
FOX_ARCH=${FOX_ARCH:-fox-pro}; FOX_PRESET=${FOX_PRESET:-125M}
FOX_SHAPE=${FOX_SHAPE-"model.d_model=512 model.n_layers=8 model.n_heads=8"}  # FOX_SHAPE= : the preset itself
FOX_SEQ=${FOX_SEQ:-2048}; FOX_BATCH=${FOX_BATCH:-16}; FOX_STEPS=${FOX_STEPS:-600}; FOX_LR=${FOX_LR:-1e-3}
FOX_WARMUP=${FOX_WARMUP:-60}
FOX_POLICIES=${FOX_POLICIES:-"dense acp $WIN_POLICY $SINK_POLICY"}
FOX_CONTEXTS=${FOX_CONTEXTS-"2048 8192 16384"}; FOX_EVAL_TOKENS=${FOX_EVAL_TOKENS:-32768}  # tokens per eval batch
FOX_NUM_DOCS=${FOX_NUM_DOCS:-4}  # documents of LONG scored at each context (the four novels)
FOX_PASSKEY_LENGTHS=${FOX_PASSKEY_LENGTHS-2048,8192,16384}
FOX_BENCH_PROMPTS=${FOX_BENCH_PROMPTS:-"2048 8192 16384"}; FOX_BENCH_BUDGET_PROMPTS=${FOX_BENCH_BUDGET_PROMPTS:-16384}
FOX_BENCH_NEW=${FOX_BENCH_NEW:-64}; FOX_EQ_BATCH=${FOX_EQ_BATCH:-4}; FOX_KV_BUDGET=${FOX_KV_BUDGET:-2}
FOX_MAX_BATCH=${FOX_MAX_BATCH:-64}; FOX_REPEATS=${FOX_REPEATS:-2}
# QUALITY=dcp: dcp-eval and zeroshot (EVAL_DIR: the eval sets of STAGES=prepare)
DE_BATCHES=${DE_BATCHES:-8}; EVAL_DIR=${EVAL_DIR:-$DATA_DIR/eval}; ZS_LIMIT=${ZS_LIMIT:-500}
ZS_TASKS=${ZS_TASKS:-lambada,piqa,winogrande,hellaswag,arc_easy}
# QUALITY=table
TABLE_RUNS=${TABLE_RUNS:-"dcp:0.05 dcp:0.1 dcp:0.2 dcp:0.4 dense"}; TABLE_STAGE=${TABLE_STAGE:-gpt2}
TABLE_MODEL=${TABLE_MODEL:-gpt2-124M}; T_TE=${T_TE:-200}; TABLE_PARALLEL=${TABLE_PARALLEL:-0}
# QUALITY=archs
ARCH_RUNS=${ARCH_RUNS:-"fox-pro fox-pro-acp fox-llama transformer-pro"}; ARCH_PRESET=${ARCH_PRESET:-125M}
ARCH_SHAPE=${ARCH_SHAPE-"model.d_model=512 model.n_layers=8 model.n_heads=8"}; ARCH_STEPS=${ARCH_STEPS:-300}
ARCH_SEQ=${ARCH_SEQ:-2048}; ARCH_BATCH=${ARCH_BATCH:-32}; ARCH_EVAL_DOCS=${ARCH_EVAL_DOCS:-32}
ARCH_RUN_LIMIT=${ARCH_RUN_LIMIT:-200}; ARCH_GPUS=${ARCH_GPUS:-1}; GATES_ARGS=${GATES_ARGS:-}
# time (s)
DEADLINE=${DEADLINE:-565}; RESERVE=${RESERVE:-12}; JOBS=${JOBS:-3}
# the stages, in order (one GPU: one training at a time; FoX first, its acp eviction is the headline)
PLAN=${PLAN:-"fox_train fox_quality bench_fox pretrain finetune gpt2_quality bench_gpt2"}
FT_PARALLEL=${FT_PARALLEL:-0}; FT_FORKS=${FT_FORKS-"ftlocal ftdense"}
T_PRE=${T_PRE:-140}; T_FT=${T_FT:-90}; T_FOX=${T_FOX:-110}; T_GQ=${T_GQ:-110}; T_FQ=${T_FQ:-60}
T_GB=${T_GB:-60}; T_FB=${T_FB:-60}; T_DE=${T_DE:-240}; T_ZS=${T_ZS:-110}; T_ARCHS=${T_ARCHS:-540}

RUNS=${RUNS:-/tmp/inference_runs}; rm -rf "$RUNS"; mkdir -p "$RUNS"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}   # shared by the processes
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}
CLI="python3 -m fox_jax.train.cli"

# ---------------------------------------------------------------------------------------------- helpers
elapsed() { echo $(( $(date +%s) - T0 )); }
stamp() { printf '[%4ss %s] %s\n' "$(elapsed)" "$(date +%H:%M:%S)" "$*" | tee -a "$R/timeline.log"; }
limit() {  # limit BUDGET: the budget, capped by the time left before DEADLINE - RESERVE
  local left=$(( DEADLINE - RESERVE - $(elapsed) )); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
STAGE=; STAGE_T=0; STAGE_END=0
stage_begin() {  # stage_begin NAME BUDGET
  STAGE=$1; STAGE_T=$(limit "$2"); STAGE_START=$(elapsed); STAGE_END=$(( STAGE_START + STAGE_T ))
  stamp "begin $STAGE (budget ${STAGE_T}s of $2)"; }
stage_end() {  # stage_end RC
  stamp "end   $STAGE rc=$1 after $(( $(elapsed) - STAGE_START ))s"
  printf '{"stage":"%s","start_s":%d,"end_s":%d,"budget_s":%d,"rc":%d}\n' "$STAGE" "$STAGE_START" "$(elapsed)" \
    "$STAGE_T" "$1" >> "$R/stages.jsonl"; }
stage_left() { echo $(( STAGE_END - $(elapsed) )); }
json_str() { python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$1"; }
job() {  # job KIND MODEL POLICY CTX LOG CMD...: runs CMD under the rest of the stage's budget, logs a jobs.jsonl row
  local kind=$1 model=$2 policy=$3 ctx=$4 log=$5; shift 5
  local t; t=$(stage_left); local s; s=$(date +%s)
  if [ "$t" -lt 5 ]; then
    echo "skipped: no time left in stage $STAGE" > "$log"; local rc=125
  else
    timeout -k 5 "$t" "$@" > "$log" 2>&1; local rc=$?
  fi
  [ $rc -ne 0 ] && stamp "  $kind $model $policy $ctx: rc=$rc ($(tail -n 1 "$log" | cut -c1-160))"
  printf '{"kind":"%s","model":"%s","policy":"%s","ctx":"%s","rc":%d,"seconds":%d,"stage":"%s","log":%s}\n' \
    "$kind" "$model" "$policy" "$ctx" "$rc" $(( $(date +%s) - s )) "$STAGE" "$(json_str "${log#$R/}")" >> "$R/jobs.jsonl"
  return $rc; }
pool() {  # pool CMD...: run in the background, at most JOBS at a time
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done; "$@" & }
safe() { echo "$1" | tr ':+/' '_p_'; }
last_step() { ls "$1/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -n 1; }
save_run() {  # save_run NAME DIR FAMILY: config + metrics (small) into the results, the model into models.txt
  [ -d "$2" ] || return 0
  mkdir -p "$R/runs/$1"; cp "$2"/config.json "$2"/metrics.jsonl "$R/runs/$1/" 2>/dev/null
  echo "$1 $2 $3" >> "$R/models.txt"; true; }

# ---------------------------------------------------------------------------------------------- S0 setup
stamp "start: QUALITY=$QUALITY PLAN=$PLAN R=$R DATA_DIR=$DATA_DIR TRAIN_DATA=$TRAIN_DATA SMOKE=$SMOKE DEADLINE=${DEADLINE}s"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}   # grain: the runner's setup installs .whl/ when needed
python3 - > "$R/env.json" <<'PY' 2> "$R/logs/env.err"
import json, platform, jax, flax
print(json.dumps({"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
                  "flax": flax.__version__, "python": platform.python_version(), "devices": jax.device_count()}))
PY
stamp "env: $(cat "$R/env.json" | cut -c1-200)"
cat > "$R/settings.env" <<EOF
QUALITY=$QUALITY PLAN="$PLAN" SMOKE=$SMOKE DTYPE=$DTYPE TRAIN_DATA=$TRAIN_DATA LONG=$LONG HAYSTACK=$HAYSTACK
GPT2_SHAPE="$GPT2_SHAPE" SEQ=$SEQ STEPS=$STEPS PRE_BATCH=$PRE_BATCH PRE_LR=$PRE_LR PRE_WARMUP=$PRE_WARMUP
FT_STEPS=$FT_STEPS FT_BATCH=$FT_BATCH FT_LR=$FT_LR FT_ILR=$FT_ILR GAMMAS="$GAMMAS" DCP_IMPL=$DCP_IMPL WINDOW=$WINDOW SINKS=$SINKS
EVAL_BATCHES=$EVAL_BATCHES NUM_DOCS=$NUM_DOCS PASSKEY_LENGTHS=$PASSKEY_LENGTHS PASSKEY_DEPTHS=$PASSKEY_DEPTHS PASSKEY_N=$PASSKEY_N
BENCH_PROMPT=$BENCH_PROMPT BENCH_NEW=$BENCH_NEW EQ_BATCH=$EQ_BATCH KV_BUDGET=$KV_BUDGET MAX_BATCH=$MAX_BATCH REPEATS=$REPEATS BENCH_MODELS="$BENCH_MODELS" POOL=$POOL BENCH_WARM=$BENCH_WARM FOX_NUM_DOCS=$FOX_NUM_DOCS
FOX_ARCH=$FOX_ARCH FOX_PRESET=$FOX_PRESET FOX_SHAPE="$FOX_SHAPE" FOX_SEQ=$FOX_SEQ FOX_BATCH=$FOX_BATCH FOX_STEPS=$FOX_STEPS FOX_LR=$FOX_LR
FOX_POLICIES="$FOX_POLICIES" FOX_CONTEXTS="$FOX_CONTEXTS" FOX_PASSKEY_LENGTHS=$FOX_PASSKEY_LENGTHS FOX_BENCH_PROMPTS="$FOX_BENCH_PROMPTS"
FOX_BENCH_BUDGET_PROMPTS="$FOX_BENCH_BUDGET_PROMPTS" FOX_BENCH_NEW=$FOX_BENCH_NEW FOX_EQ_BATCH=$FOX_EQ_BATCH FOX_KV_BUDGET=$FOX_KV_BUDGET FOX_MAX_BATCH=$FOX_MAX_BATCH
ARCH_RUNS="$ARCH_RUNS" ARCH_PRESET=$ARCH_PRESET ARCH_SHAPE="$ARCH_SHAPE" ARCH_STEPS=$ARCH_STEPS ARCH_SEQ=$ARCH_SEQ ARCH_BATCH=$ARCH_BATCH
ZS_LIMIT=$ZS_LIMIT ZS_TASKS=$ZS_TASKS EVAL_DIR=$EVAL_DIR
TABLE_RUNS="$TABLE_RUNS" TABLE_STAGE=$TABLE_STAGE TABLE_PARALLEL=$TABLE_PARALLEL DE_BATCHES=$DE_BATCHES T_TE=$T_TE
DEADLINE=$DEADLINE T_PRE=$T_PRE T_FT=$T_FT T_FOX=$T_FOX T_GQ=$T_GQ T_FQ=$T_FQ T_GB=$T_GB T_FB=$T_FB T_DE=$T_DE T_ZS=$T_ZS T_ARCHS=$T_ARCHS JOBS=$JOBS
EOF
# warm the token cache of the evaluation texts while the GPU pretrains (CPU only)
( JAX_PLATFORMS=cpu python3 - "$TRAIN_DATA" "$LONG" "$HAYSTACK" "$TOK" > "$R/logs/warm_cache.log" 2>&1 <<'PY'
import sys
from fox_jax.train import config as C, data as D
train, long, hay, tok = sys.argv[1:]
for val in {long, hay}:
    D.load_corpus(C.DataConfig(train=(train,), val=(val,), tokenizer=tok, seq_len=64))
    print("cached", val)
PY
) &
WARM_PID=$!

# ---------------------------------------------------------------------------------------------- S1 pretrain
PRE=$RUNS/gpt2; FOX=$RUNS/fox; PRE_STEP=; FOX_STEP=
stage_pretrain() {
  stage_begin pretrain "$T_PRE"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 job train gpt2 - "$SEQ" "$R/logs/pretrain.log" \
    $CLI train --preset gpt2 --workdir "$PRE" --data "$TRAIN_DATA" $VAL_ARGS --tokenizer "$TOK" --seq-len "$SEQ" \
    --batch-size "$PRE_BATCH" --steps "$STEPS" --lr "$PRE_LR" --warmup-steps "$PRE_WARMUP" --dtype "$DTYPE" \
    --eval-every 0 --eval-batches "$EVAL_BATCHES" --log-every 50 --ckpt-every $(( STEPS / 4 > 0 ? STEPS / 4 : 1 )) \
    --no-progress $GPT2_SHAPE
  stage_end $?
  PRE_STEP=$(last_step "$PRE"); save_run pre "$PRE" gpt2
  stamp "pretrain: last checkpoint step ${PRE_STEP:-none}; $(grep -E '^step|^done' "$R/logs/pretrain.log" | tail -n 1 | cut -c1-200)"; }

# ---------------------------------------------------------------------------------------------- S2 finetune
fork_run() {  # fork_run SRC DST STEPS [PATTERN]: a 'fox-jax train' run continued as a fine-tune (hard-linked checkpoint)
  python3 - "$@" <<'PY'
import json, os, shutil, sys
src, dst, steps, pattern = sys.argv[1], sys.argv[2], int(sys.argv[3]), (sys.argv[4] if len(sys.argv) > 4 else "")
ck = sorted(int(s) for s in os.listdir(os.path.join(src, "checkpoints")) if s.isdigit())[-1]
os.makedirs(os.path.join(dst, "checkpoints"))
os.system(f"cp -al '{src}/checkpoints/{ck}' '{dst}/checkpoints/{ck}'")  # orbax never rewrites a finished step
shutil.copy(os.path.join(src, "metrics.jsonl"), dst)
cfg = json.load(open(os.path.join(src, "config.json")))
cfg["model"]["sparse_pattern"] = pattern or None
if pattern:
    cfg["model"]["dcp_impl"] = os.environ.get("DCP_IMPL", "xla")
cfg["optim"].update(lr=float(os.environ["FT_LR"]), schedule="constant", warmup_steps=0, weight_decay=0.0)
# the fine-tunes' batch, not the pretraining's: a control on twice the DCP runs' tokens is no control
cfg.update(steps=ck + steps, batch_size=int(os.environ.get("FT_BATCH") or cfg["batch_size"]))
# ... and the fine-tunes' batches: the data restarts at the first batch of that size, as finetune-dcp --from-run
# does (same seed, same windows), so the control and the DCP runs see the same tokens in the same order
meta = os.path.join(dst, "checkpoints", str(ck), "data", "metadata")
state = json.load(open(meta))
state["grain"]["next_index"] = 0
state["pipeline"]["batch_size"] = cfg["batch_size"]
os.unlink(meta)  # a hard link to the source run's file: replaced, not written through
json.dump(state, open(meta, "w"))
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
print(ck + steps)
PY
}
ft_dcp() {  # ft_dcp GAMMA: DCP_IMPL first; if that fails before its first checkpoint, once more with xla
  local g=$1 dir=$RUNS/dcp_g$1 impl
  for impl in $DCP_IMPL xla; do
    job finetune "dcp_g$g" dcp "$SEQ" "$R/logs/finetune_dcp_g${g}_$impl.log" $CLI finetune-dcp --from-run "$PRE" \
      --workdir "$dir" --batch-size "$FT_BATCH" --steps "$FT_STEPS" --lr "$FT_LR" --interaction-lr "$FT_ILR" \
      --gamma "$g" --dtype "$DTYPE" --dcp-impl "$impl" --eval-every 0 --eval-batches "$EVAL_BATCHES" --log-every 10 \
      --ckpt-every $(( FT_STEPS / 2 > 0 ? FT_STEPS / 2 : 1 )) --no-progress && return 0
    [ -n "$(last_step "$dir")" ] || [ "$impl" = xla ] && return 1   # cut after a checkpoint: keep it
    rm -rf "$dir"
  done; }
ft_fork() {  # ft_fork NAME [PATTERN]
  local dir=$RUNS/$1 total
  total=$(FT_LR=$FT_LR FT_BATCH=$FT_BATCH DCP_IMPL=$DCP_IMPL fork_run "$PRE" "$dir" "$FT_STEPS" "${2:-}") || return 1
  job finetune "$1" "${2:-dense}" "$SEQ" "$R/logs/finetune_$1.log" $CLI train --workdir "$dir" --resume \
    --steps "$total" --log-every 10 --eval-every 0 --ckpt-every $(( FT_STEPS / 2 > 0 ? FT_STEPS / 2 : 1 )) --no-progress; }
GPT2_MODELS=(pre)
stage_finetune() {
stage_begin finetune "$T_FT"
if [ -n "$PRE_STEP" ]; then
  if [ "$FT_PARALLEL" = 1 ]; then
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
    for g in $GAMMAS; do ft_dcp "$g" & done
    for m in $FT_FORKS; do ft_fork "$m" $([ "$m" = ftlocal ] && echo "local:$WINDOW") & done
    wait; unset XLA_PYTHON_CLIENT_MEM_FRACTION
  else  # one at a time: a single GPU runs one fine-tune at full speed, not four at a quarter
    for g in $GAMMAS; do ft_dcp "$g"; done
    for m in $FT_FORKS; do ft_fork "$m" $([ "$m" = ftlocal ] && echo "local:$WINDOW"); done
  fi
  for g in $GAMMAS; do [ -n "$(last_step "$RUNS/dcp_g$g")" ] && GPT2_MODELS+=("dcp_g$g") && save_run "dcp_g$g" "$RUNS/dcp_g$g" gpt2-dcp; done
  for m in ftlocal ftdense; do
    if [ -n "$(last_step "$RUNS/$m")" ] && [ "$(last_step "$RUNS/$m")" != "$PRE_STEP" ]; then
      GPT2_MODELS+=("$m"); save_run "$m" "$RUNS/$m" gpt2
      # decoding reads the window from the cache policy, not from the model: the fine-tuned local:W model is
      # evaluated as a dense model under the window:W policy (same visibility: the last W tokens, itself included)
      python3 - "$RUNS/$m/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["model"]["sparse_pattern"] = None
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
    fi
  done
  stage_end 0
else
  stamp "finetune: skipped (no pretrained checkpoint)"; stage_end 1
fi
stamp "GPT-2 models: ${GPT2_MODELS[*]}"
for g in $GAMMAS; do stamp "  dcp_g$g: $(grep -E '^done' "$R"/logs/finetune_dcp_g$g*.log 2>/dev/null | tail -n 1 | cut -c1-200)"; done
}

# ---------------------------------------------------------------------------------------------- S3 fox-train || gpt2-quality
policies_of() {  # the cache policies of a GPT-2 model (eval --cache scores dense on the same tokens anyway)
  case $1 in
    pre|ftdense) echo "dense $WIN_POLICY $SINK_POLICY" ;;
    ftlocal) echo "$WIN_POLICY dense" ;;
    dcp_g*) echo "dcp dense" ;;
  esac; }
run_dir() { case $1 in pre) echo "$PRE" ;; fox) echo "$FOX" ;; *) echo "$RUNS/$1" ;; esac; }
eval_job() {  # eval_job MODEL POLICY CTX [overrides...]: ppl under POLICY and dense on the same documents
  local m=$1 p=$2 c=$3; shift 3
  local d; d=$(run_dir "$m")
  XLA_PYTHON_CLIENT_PREALLOCATE=false job eval "$m" "$p" "$c" "$R/quality/${m}__$(safe "$p")__$c.log" \
    $CLI eval --workdir "$d" --cache "$p" "$@"; }
passkey_job() {  # passkey_job MODEL POLICY LENGTHS
  local m=$1 p=$2 l=$3 d; d=$(run_dir "$m")
  XLA_PYTHON_CLIENT_PREALLOCATE=false job passkey "$m" "$p" "$l" "$R/passkey/${m}__$(safe "$p").log" \
    $CLI passkey "$d" --lengths "$l" --depths "$PASSKEY_DEPTHS" --n "$PASSKEY_N" --cache "$p" --text "$HAYSTACK" \
    --out "$R/passkey/${m}__$(safe "$p")" --no-progress; }
# bench_decode.py runs twice: first with --repeats 0 in the background of the quality stages (GPU shared,
# nothing timed: it fills the persistent compilation cache), then timed, alone on the GPU, with the programs
# loaded from that cache (same shapes: the calibration and the budget batch are deterministic).
bench_job() {  # bench_job WARM MODEL POLICIES NAME ARGS...
  local warm=$1 m=$2 p=$3 name=$4; shift 4
  local dir=$R/bench kind=bench extra=()
  [ "$warm" = 1 ] && dir=$R/bench/warm && kind=benchwarm && extra=(--repeats 0)
  mkdir -p "$dir"
  XLA_PYTHON_CLIENT_PREALLOCATE=$([ "$warm" = 1 ] && echo false || echo true) \
    job $kind "$m" "$p" - "$dir/$name.log" python3 benchmarks/bench_decode.py --run "$(run_dir "$m")" --policies "$p" \
    --dtype "$DTYPE" --pool "$POOL" --out "$dir/$name.json" "$@" "${extra[@]}"; }
gpt2_benches() {  # gpt2_benches WARM: the GPT-2 models of BENCH_MODELS (WARM=1: queued in the pool)
  local run=(); [ "$1" = 1 ] && run=(pool)
  local args=(--prompt-lengths "$BENCH_PROMPT" --new-tokens "$BENCH_NEW" --equal-batch "$EQ_BATCH" --kv-budget "$KV_BUDGET"
              --max-batch "$MAX_BATCH" --repeats "$REPEATS" --prefill budget --prompt-text "$HAYSTACK" --tokenizer "$TOK")
  for m in "${GPT2_MODELS[@]}"; do
    case $m in
      pre) [[ " $BENCH_MODELS " == *" pre "* ]] && "${run[@]}" bench_job "$1" pre "dense,$WIN_POLICY,$SINK_POLICY" pre "${args[@]}" ;;
      dcp_g*) [[ " $BENCH_MODELS " == *" dcp "* ]] && "${run[@]}" bench_job "$1" "$m" dcp "$m" "${args[@]}" ;;
      ftlocal) [[ " $BENCH_MODELS " == *" ftlocal "* ]] && "${run[@]}" bench_job "$1" ftlocal "$WIN_POLICY" ftlocal "${args[@]}" ;;
      ftdense) [[ " $BENCH_MODELS " == *" ftdense "* ]] && "${run[@]}" bench_job "$1" ftdense dense ftdense "${args[@]}" ;;
    esac
  done; true; }
fox_benches() {  # fox_benches WARM
  local run=(); [ "$1" = 1 ] && run=(pool)
  local fp; fp=$(echo $FOX_POLICIES | tr ' ' ',')
  local args=(--new-tokens "$FOX_BENCH_NEW" --max-batch "$FOX_MAX_BATCH" --repeats "$FOX_REPEATS" --prompt-text "$LONG"
              --tokenizer "$TOK")
  "${run[@]}" bench_job "$1" fox "$fp" fox_budget --prompt-lengths $FOX_BENCH_BUDGET_PROMPTS --kv-budget "$FOX_KV_BUDGET" \
    --prefill budget "${args[@]}"
  "${run[@]}" bench_job "$1" fox "$fp" fox_equal --prompt-lengths $FOX_BENCH_PROMPTS --equal-batch "$FOX_EQ_BATCH" \
    --prefill none "${args[@]}"; }
stage_fox_train() {
  stage_begin fox-train "$T_FOX"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 job train fox - "$FOX_SEQ" "$R/logs/fox_train.log" \
    $CLI train --preset "$FOX_PRESET" --arch "$FOX_ARCH" --workdir "$FOX" --data "$TRAIN_DATA" $VAL_ARGS \
    --tokenizer "$TOK" --seq-len "$FOX_SEQ" --batch-size "$FOX_BATCH" --steps "$FOX_STEPS" --lr "$FOX_LR" \
    --warmup-steps "$FOX_WARMUP" --dtype "$DTYPE" --eval-every 0 --eval-batches 4 --log-every 50 \
    --ckpt-every $(( FOX_STEPS / 3 > 0 ? FOX_STEPS / 3 : 1 )) --no-progress $FOX_SHAPE
  stage_end $?
  FOX_STEP=$(last_step "$FOX"); [ -n "$FOX_STEP" ] && save_run fox "$FOX" fox
  stamp "fox: last checkpoint step ${FOX_STEP:-none}; $(grep -E '^step|^done' "$R/logs/fox_train.log" | tail -n 1 | cut -c1-200)"; }
stage_gpt2_quality() {
  stage_begin gpt2-quality "$T_GQ"
  wait "$WARM_PID" 2>/dev/null
  for m in "${GPT2_MODELS[@]}"; do
    for p in $(policies_of "$m"); do
      [ "$p" != dense ] && pool eval_job "$m" "$p" "$SEQ" --num-docs "$NUM_DOCS"
      [ -n "$PASSKEY_LENGTHS" ] && pool passkey_job "$m" "$p" "$PASSKEY_LENGTHS"
    done
    [ "$m" = pre ] && [ "$BENCH_WARM" = 1 ] && gpt2_benches 1
  done; wait
  stage_end 0; }

# ---------------------------------------------------------------------------------------------- S4 fox-quality
stage_fox_quality() {
wait "$WARM_PID" 2>/dev/null
stage_begin fox-quality "$T_FQ"
if [ -n "$FOX_STEP" ]; then
  for c in $FOX_CONTEXTS; do
    for p in $FOX_POLICIES; do
      [ "$p" != dense ] && pool eval_job fox "$p" "$c" --num-docs "$FOX_NUM_DOCS" data.val="$LONG" data.seq_len="$c" \
        batch_size=$(( FOX_EVAL_TOKENS / c > 0 ? FOX_EVAL_TOKENS / c : 1 ))
    done
  done
  [ -n "$FOX_PASSKEY_LENGTHS" ] && for p in $FOX_POLICIES; do pool passkey_job fox "$p" "$FOX_PASSKEY_LENGTHS"; done
  [ "$BENCH_WARM" = 1 ] && fox_benches 1
  wait; stage_end 0
else
  stamp "fox-quality: skipped (no FoX checkpoint)"; stage_end 1
fi
}

# ---------------------------------------------------------------------------------------------- S5/S6 bench
stage_bench_gpt2() { stage_begin bench-gpt2 "$T_GB"; gpt2_benches 0; stage_end 0; }
stage_bench_fox() {
  stage_begin bench-fox "$T_FB"
  if [ -n "$FOX_STEP" ]; then fox_benches 0; stage_end 0; else stamp "bench-fox: skipped (no FoX checkpoint)"; stage_end 1; fi; }
# ---------------------------------------------------------------------------------------------- QUALITY=dcp
hf_export() {  # the pretrained GPT-2 as a Hugging Face directory ($PRE/hf; a run cut before its end has none yet)
  [ -f "$PRE/hf/model.safetensors" ] && return 0
  [ -n "$PRE_STEP" ] || return 1
  stamp "pretraining was cut: exporting its step-$PRE_STEP checkpoint"   # a resume to its own step trains nothing
  timeout -k 5 "$(stage_left)" $CLI train --workdir "$PRE" --resume --steps "$PRE_STEP" --no-progress \
    >> "$R/logs/hf_export.log" 2>&1; }
stage_dcp_eval() {
  stage_begin dcp-eval "$T_DE"
  local runs=(); for g in $GAMMAS; do [ -n "$(last_step "$RUNS/dcp_g$g")" ] && runs+=("$RUNS/dcp_g$g"); done
  if hf_export && [ ${#runs[@]} -gt 0 ]; then
    job dcp-eval gpt2 dcp "$SEQ" "$R/logs/dcp_eval.log" $CLI dcp-eval --dense "$PRE/hf" --runs "${runs[@]}" \
      --data "$TRAIN_DATA" --seq-len "$SEQ" --num-batches "$DE_BATCHES" --batch-size 8 --dtype "$DTYPE" \
      --out "$R/dcp_eval" --no-progress
    stage_end $?
  else
    stamp "dcp-eval: skipped (no exported pretrained model or no DCP fine-tune)"; stage_end 1
  fi; }
stage_zeroshot() {
  stage_begin zeroshot "$T_ZS"
  if [ ! -d "$EVAL_DIR" ]; then  # STAGES=prepare copies the zero-shot sets only when asked (the carry limit)
    stamp "zeroshot: skipped (no $EVAL_DIR: run STAGES=prepare with PREPARE_EVAL=1 on the CPU machine and carry .gpu)"
    stage_end 1; return
  fi
  local mid; mid=$(echo $GAMMAS | awk '{print $(NF > 1 ? 2 : 1)}'); mkdir -p "$R/zeroshot"
  hf_export && job zeroshot pre dense - "$R/logs/zeroshot_dense.log" $CLI zeroshot --hf-gpt2 "$PRE/hf" \
    --tasks "$ZS_TASKS" --eval-dir "$EVAL_DIR" --limit "$ZS_LIMIT" --batch-size 32 --output "$R/zeroshot/dense.json" \
    --no-progress
  [ -n "$(last_step "$RUNS/dcp_g$mid")" ] && job zeroshot "dcp_g$mid" dcp - "$R/logs/zeroshot_dcp_g$mid.log" \
    $CLI zeroshot --workdir "$RUNS/dcp_g$mid" --dcp --tasks "$ZS_TASKS" --eval-dir "$EVAL_DIR" --limit "$ZS_LIMIT" \
    --batch-size 32 --output "$R/zeroshot/dcp_g$mid.json" --no-progress
  stage_end $?; }

# ---------------------------------------------------------------------------------------------- QUALITY=table
TABLE_DCP=(); TABLE_CTRL=()
if [ -n "${TABLE_MATCH:-}" ]; then  # TABLE_RUNS from an earlier call's table/dcp_eval.json (module header)
  TABLE_RUNS=$(python3 - "$TABLE_MATCH" "$SEQ" "${TABLE_MATCH_RUNS:-}" "${TABLE_MATCH_KINDS:-local strided sinks}" <<'PY'
import json, sys
from fox_jax.models.gpt2 import match_sparse_pattern
report, t = json.load(open(sys.argv[1])), int(sys.argv[2])
labels, kinds = sys.argv[3].split(), sys.argv[4].split()
items = []
for run in report["dcp"]:
    if not labels or run["label"] in labels:
        items += [match_sparse_pattern(k, run["sparsity"], t)[0] for k in kinds]
print(" ".join(dict.fromkeys(items + ["dense"])))
PY
) || { echo "TABLE_MATCH=$TABLE_MATCH: could not match patterns" >&2; exit 2; }
fi
table_dir() {  # table_dir ITEM: the run directory of one TABLE_RUNS item
  case $1 in dcp:*) echo "$RUNS/dcp_g${1#dcp:}" ;; dense) echo "$RUNS/ftdense" ;; *) echo "$RUNS/ft_$(safe "$1")" ;; esac; }
table_ft() {  # table_ft ITEM: fine-tune one TABLE_RUNS item from the pretrained checkpoint
  case $1 in
    dcp:*) ft_dcp "${1#dcp:}" ;;
    dense) ft_fork ftdense ;;
    local:*|strided:*|sinks:*) ft_fork "ft_$(safe "$1")" "$1" ;;
    *) stamp "TABLE_RUNS: unknown item '$1' (dcp:<gamma> | dense | local:W | strided:S | sinks:S+W)"; return 2 ;;
  esac; }
stage_table_finetune() {
  stage_begin table-finetune "$T_FT"
  if [ -z "$PRE_STEP" ]; then stamp "table-finetune: skipped (no pretrained checkpoint)"; stage_end 1; return; fi
  local item dir n
  if [ "$TABLE_PARALLEL" = 1 ]; then  # all at once, each with its share of the GPU's memory: the processes'
    n=$(echo $TABLE_RUNS | wc -w)     # start-up, restore, compile and export overlap (most of a short fine-tune)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $n, 3))")
    for item in $TABLE_RUNS; do table_ft "$item" & done; wait; unset XLA_PYTHON_CLIENT_MEM_FRACTION
  else
    for item in $TABLE_RUNS; do table_ft "$item"; done
  fi
  for item in $TABLE_RUNS; do
    dir=$(table_dir "$item"); [ -n "$(last_step "$dir")" ] || continue
    case $item in
      dcp:*) TABLE_DCP+=("$dir"); save_run "dcp_g${item#dcp:}" "$dir" gpt2-dcp ;;
      *) [ "$(last_step "$dir")" != "$PRE_STEP" ] && TABLE_CTRL+=("$dir") && save_run "$(basename "$dir")" "$dir" gpt2 ;;
    esac
  done
  stamp "table models: dcp ${TABLE_DCP[*]##*/} | controls ${TABLE_CTRL[*]##*/}"
  stage_end 0; }
stage_table_eval() {
  stage_begin table-eval "$T_TE"
  if [ -z "$PRE_STEP" ]; then stamp "table-eval: skipped (no pretrained checkpoint)"; stage_end 1; return; fi
  local args=() d label policy
  [ ${#TABLE_DCP[@]} -gt 0 ] && args+=(--runs "${TABLE_DCP[@]}")
  [ ${#TABLE_CTRL[@]} -gt 0 ] && args+=(--controls "${TABLE_CTRL[@]}")
  # dcp-eval writes its JSON once the models' own scores are in (the untuned baselines follow): it shares the GPU
  # with the passkey jobs, none of them preallocating
  XLA_PYTHON_CLIENT_PREALLOCATE=false pool job dcp-eval gpt2 table "$SEQ" "$R/logs/table_dcp_eval.log" $CLI dcp-eval \
    --dense "$PRE" "${args[@]}" --data "$TRAIN_DATA" $VAL_ARGS --tokenizer "$TOK" --seq-len "$SEQ" \
    --num-batches "$DE_BATCHES" --batch-size 8 --curve-sparsities "" --dtype "$DTYPE" --out "$R/table" --no-progress
  for d in "$PRE" "${TABLE_DCP[@]}" "${TABLE_CTRL[@]}"; do  # passkey under the policy that decodes the model's mask
    [ -n "$PASSKEY_LENGTHS" ] || break
    label=$(basename "$d"); [ "$d" = "$PRE" ] && label=dense
    case $label in
      dense|ftdense) policy=dense ;; dcp_g*) policy=dcp ;; ft_local_*) policy=window:${label#ft_local_} ;;
      ft_sinks_*) policy=$(echo "${label#ft_}" | sed 's/_/:/; s/p/+/') ;; *) continue ;;   # strided: no policy
    esac
    XLA_PYTHON_CLIENT_PREALLOCATE=false pool job passkey "$label" "$policy" "$PASSKEY_LENGTHS" \
      "$R/logs/table_passkey_$label.log" $CLI passkey "$d" --lengths "$PASSKEY_LENGTHS" --depths "$PASSKEY_DEPTHS" \
      --n "$PASSKEY_N" --cache "$policy" --text "$HAYSTACK" --tokenizer "$TOK" --out "$R/table_passkey/$label" \
      --no-progress
  done; wait
  timeout 60 python3 benchmarks/plots/plot_quality.py "$R" --model "$TABLE_MODEL" --stage "$TABLE_STAGE" \
    --rows "$R/quality_rows.json" --out-dir "$R" > "$R/logs/plot_quality.log" 2>&1
  local rc=$?; [ $rc -ne 0 ] && stamp "plot_quality.py failed: $(tail -n 1 "$R/logs/plot_quality.log")"
  stage_end $rc; }

# ---------------------------------------------------------------------------------------------- QUALITY=archs
arch_run() {  # arch_run NAME: train NAME (an --arch, or ARCH-acp), then its per-position evaluation
  local name=$1 arch=${1%-acp} extra=()
  [ "$arch" != "$name" ] && extra=(model.adaptive_threshold=auto)
  job train "$name" - "$ARCH_SEQ" "$R/logs/train_$name.log" timeout -k 5 "$ARCH_RUN_LIMIT" $CLI train \
    --preset "$ARCH_PRESET" --arch "$arch" --workdir "$RUNS/$name" --data "$TRAIN_DATA" $VAL_ARGS --tokenizer "$TOK" \
    --steps "$ARCH_STEPS" --seq-len "$ARCH_SEQ" --batch-size "$ARCH_BATCH" --no-progress $ARCH_SHAPE eval_every=50 \
    eval_batches=8 log_every=10 ckpt_every=50 optim.warmup_steps=30 "${extra[@]}"
  job eval "$name" - "$ARCH_SEQ" "$R/logs/eval_$name.log" $CLI eval --workdir "$RUNS/$name" --num-docs "$ARCH_EVAL_DOCS"
  save_run "$name" "$RUNS/$name" arch; cp "$RUNS/$name"/eval/*.json "$R/runs/$name/" 2>/dev/null; true; }
stage_archs() {
  stage_begin archs "$T_ARCHS"
  local g i name
  for g in $(seq 0 $(( ARCH_GPUS - 1 ))); do  # run i on GPU i mod ARCH_GPUS, the GPUs in parallel
    ( [ "$ARCH_GPUS" -gt 1 ] && export CUDA_VISIBLE_DEVICES=$g
      i=0; for name in $ARCH_RUNS; do [ $(( i % ARCH_GPUS )) = "$g" ] && arch_run "$name"; i=$(( i + 1 )); done ) &
  done; wait
  [ -n "$(last_step "$RUNS/fox-pro")" ] && job bench fox-pro acp - "$R/logs/attention_trained_gates.log" \
    python3 benchmarks/bench_attention.py --impls pallas,pallas-acp --gates-from "$RUNS/fox-pro" $GATES_ARGS \
    --out "$R/attention_trained_gates.json"
  local ref=; [[ " $ARCH_RUNS " == *" transformer-pro "* ]] && ref="--reference transformer-pro"
  timeout 60 python3 benchmarks/plots/plot_experiment.py "$R"/runs/*/ --out "$R" $ref > "$R/summary.md" \
    2> "$R/logs/plot.log"
  stage_end $?; }

for st in $PLAN; do "stage_$st"; done

# ---------------------------------------------------------------------------------------------- collect
stamp "collect"
if [ "$QUALITY" = inference ]; then
  for m in "${GPT2_MODELS[@]}" fox; do  # the eval JSONs the runs wrote
    d=$(run_dir "$m"); [ -d "$d/eval" ] && mkdir -p "$R/runs/$m/eval" && cp "$d"/eval/*.json "$R/runs/$m/eval/" 2>/dev/null
  done
  timeout 20 python3 benchmarks/plots/plot_inference.py "$R" --out-dir "$R" > "$R/logs/plot.log" 2>&1 \
    || stamp "plot_inference.py failed: $(tail -n 1 "$R/logs/plot.log")"
  if [ -n "$FOX_STEP" ] && [ -f "$R/summary.json" ]; then  # the FoX rows of quality_h200.json
    timeout 30 python3 benchmarks/plots/plot_quality.py "$R" --model "$FOX_ARCH-$FOX_PRESET${FOX_SHAPE:+-reduced}" \
      --stage "$FOX_ARCH" --rows "$R/quality_rows.json" --out-dir "$R" > "$R/logs/plot_quality.log" 2>&1 \
      || stamp "plot_quality.py failed: $(tail -n 1 "$R/logs/plot_quality.log")"
  fi
fi
wait "$WARM_PID" 2>/dev/null
stamp "done; total $(elapsed)s"
