#!/usr/bin/env bash
# Issue 5's experiment on one GPU (set CUDA_VISIBLE_DEVICES): pretrain a GPT-2-shaped model on Gutenberg
# (fox-jax pretrain-gpt2), DCP-fine-tune it at three γ (fox-jax finetune-dcp), then fox-jax dcp-eval
# (ppl vs sparsity against local/strided baselines at matched sparsity, drop plots, context switch) and
# fox-jax zeroshot for the dense and a pruned model. Results in $R (default $OUT/dcp). Each stage has its
# own time limit, so a slow stage costs only itself; pretraining checkpoints every 100 steps and a cut run
# is exported from its last checkpoint. H200 timing (8 x 512, T=1024, bf16): pretraining 430–510k tokens/s
# (1000 steps of 32 x 1024 tokens in < 170 s incl. compile), fine-tuning ~105k tokens/s (< 70 s per γ),
# zero-shot < 40 s per model; dcp-eval needs more than 90 s (it was cut there once; limit now 240 s).
# Needs: the pre-tokenized Gutenberg ($DATA, see run_gpu_train.sh) and the eval sets ($EVAL_DIR).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=${R:-$OUT/dcp}; mkdir -p "$R"
DATA=${DATA:-$PWD/.gpu/gutenberg}; EVAL_DIR=${EVAL_DIR:-$PWD/../shared/data/eval}; RUNS=${RUNS:-/tmp/dcp_runs}
SHAPE=${SHAPE:-"--n-layer 8 --n-embd 512 --n-head 8 --n-positions 1024"}; SEQ=${SEQ:-1024}
PRE_STEPS=${PRE_STEPS:-1000}; PRE_BATCH=${PRE_BATCH:-32}; FT_STEPS=${FT_STEPS:-200}; FT_BATCH=${FT_BATCH:-8}
GAMMAS=${GAMMAS:-"0.1 0.3 1.0"}; DTYPE=${DTYPE:-bfloat16}; ZS_LIMIT=${ZS_LIMIT:-500}
T_PRE=${T_PRE:-200}; T_FT=${T_FT:-80}; T_EVAL=${T_EVAL:-240}; T_ZS=${T_ZS:-50}
export PYTHONUNBUFFERED=1
timeout $T_PRE python3 -m fox_jax.train.cli pretrain-gpt2 --workdir $RUNS/gpt2 $SHAPE --data $DATA --tokenizer $DATA/tokenizer \
  --seq-len $SEQ --batch-size $PRE_BATCH --steps $PRE_STEPS --warmup-steps 60 --lr 1e-3 --dtype $DTYPE \
  --eval-every 200 --eval-batches 8 --log-every 20 --ckpt-every 100 --no-progress > "$R/pretrain.log" 2>&1
if [ ! -f $RUNS/gpt2/hf/model.safetensors ] && ls -d $RUNS/gpt2/checkpoints/[0-9]* > /dev/null 2>&1; then
  # cut by its time limit: export the last checkpoint (a resume with steps = that step trains nothing)
  last=$(ls $RUNS/gpt2/checkpoints | grep -E '^[0-9]+$' | sort -n | tail -1)
  echo "pretraining was cut; exporting its step-$last checkpoint" >> "$R/pretrain.log"
  python3 -m fox_jax.train.cli pretrain-gpt2 --workdir $RUNS/gpt2 --resume --steps $last --no-progress >> "$R/pretrain.log" 2>&1
fi
cp $RUNS/gpt2/metrics.jsonl "$R/pretrain_metrics.jsonl" 2>/dev/null
done_runs=()
for g in $GAMMAS; do
  timeout $T_FT python3 -m fox_jax.train.cli finetune-dcp --workdir $RUNS/dcp_g$g --hf-gpt2 $RUNS/gpt2/hf --data $DATA \
    --seq-len $SEQ --batch-size $FT_BATCH --steps $FT_STEPS --lr 3e-4 --interaction-lr 3e-3 --gamma $g \
    --dtype $DTYPE --eval-every 0 --eval-batches 8 --log-every 10 --ckpt-every 0 --no-progress > "$R/finetune_g$g.log" 2>&1 \
    && done_runs+=($RUNS/dcp_g$g)
  cp $RUNS/dcp_g$g/metrics.jsonl "$R/finetune_g${g}_metrics.jsonl" 2>/dev/null
done
timeout $T_EVAL python3 -m fox_jax.train.cli dcp-eval --dense $RUNS/gpt2/hf --runs "${done_runs[@]}" --data $DATA --seq-len $SEQ \
  --num-batches 8 --batch-size 8 --dtype $DTYPE --out "$R/eval" --no-progress > "$R/dcp_eval.log" 2>&1
mid=$(echo $GAMMAS | awk '{print $2}')
timeout $T_ZS python3 -m fox_jax.train.cli zeroshot --hf-gpt2 $RUNS/gpt2/hf --tasks lambada,piqa,winogrande,hellaswag,arc_easy \
  --eval-dir $EVAL_DIR --limit $ZS_LIMIT --batch-size 32 --output "$R/zeroshot_dense.json" --no-progress > "$R/zeroshot.log" 2>&1
timeout $T_ZS python3 -m fox_jax.train.cli zeroshot --workdir $RUNS/dcp_g$mid --tasks lambada,piqa,winogrande,hellaswag,arc_easy \
  --eval-dir $EVAL_DIR --limit $ZS_LIMIT --batch-size 32 --output "$R/zeroshot_dcp_g$mid.json" --no-progress >> "$R/zeroshot.log" 2>&1
true
