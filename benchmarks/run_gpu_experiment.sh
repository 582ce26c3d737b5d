#!/usr/bin/env bash
# Issue 4's first experiment, one call on the 2-GPU machine (nvidia-h200-x2), ~9 minutes:
#   phase 1 (in parallel): GPU 0 — FoX (Pro) with ACP off, then on, then the attention benchmark with the
#            trained FoX (Pro)'s gates; GPU 1 — FoX (LLaMA), then Transformer (Pro), then the GPU kernel tests;
#   phase 2 (both GPUs): 760M FoX (Pro) at 16k on data=2 and fsdp=2 (scaling; the 1-GPU rows come from
#            run_gpu_bench_train.sh), written straight to $OUT.
# ONE_GPU=1 runs the same in sequence on the visible GPU (EXTRA_CMD: one more command before the gates benchmark).
# Every model: the same small shape (d 512, 8 layers, 8 heads of 64; GPT-2 vocabulary), the same
# batches (data seed 0) of Gutenberg with the GPT-2 tokenizer, STEPS x 32 x 2048 tokens; then
# `fox-jax eval` for the per-position loss. Everything lands in $OUT/experiment.tar.gz.
# Needs .whl/ (grain etc.) and .gpu/gutenberg (see run_gpu_train.sh).
# H200 timing of one run (d 512 x 8 layers, 32 x 2048 tokens/step): ~390k tokens/s, 250 steps ≈ 42 s plus
# ~60 s of compilation and evaluations; checkpoints every 50 steps, so a run cut by RUN_LIMIT still evaluates.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-300}; SEQ=${SEQ:-2048}; BATCH=${BATCH:-32}; P0_LIMIT=${P0_LIMIT:-150}; RUN_LIMIT=${RUN_LIMIT:-200}
SHAPE=${SHAPE:-"model.d_model=512 model.n_layers=8 model.n_heads=8"}
PRESET=${PRESET:-125M}; DATA=${DATA:-$PWD/.gpu/gutenberg}
R=$OUT/exp; mkdir -p "$R"; RUNS=/tmp/exp_runs; mkdir -p $RUNS
export PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"


train() {  # name arch extra-overrides...
  local name=$1 arch=$2; shift 2
  timeout $RUN_LIMIT python3 -m fox_jax.train.cli train --preset $PRESET --arch $arch --data $DATA --tokenizer $DATA/tokenizer \
    --workdir $RUNS/$name --steps $STEPS --seq-len $SEQ --batch-size $BATCH --no-progress \
    $SHAPE eval_every=50 eval_batches=8 log_every=10 ckpt_every=50 optim.warmup_steps=30 "$@" > "$R/$name.log" 2>&1
  timeout 60 python3 -m fox_jax.train.cli eval --workdir $RUNS/$name --num-docs 32 >> "$R/$name.log" 2>&1
  mkdir -p "$R/$name"; cp $RUNS/$name/metrics.jsonl $RUNS/$name/config.json "$R/$name/" 2>/dev/null
  cp $RUNS/$name/eval/*.json "$R/$name/" 2>/dev/null; true
}
gates_bench() {
  timeout ${GATES_LIMIT:-120} python3 benchmarks/bench_attention.py --impls pallas,pallas-acp --gates-from $RUNS/fox-pro \
    ${BENCH_EXTRA:-} --out "$R/attention_trained_gates.json" > "$R/attention_trained_gates.log" 2>&1
}
gpu_tests() {
  [ "${SKIP_GPU_TESTS:-0}" = 1 ] || timeout 120 python3 -m pytest -q -m gpu tests/test_pallas.py -p no:cacheprovider > "$R/gpu_tests.log" 2>&1
}
if [ "${ONE_GPU:-0}" = 1 ]; then  # everything in sequence on the visible GPU
  train fox-pro fox-pro
  train fox-pro-acp fox-pro model.adaptive_threshold=auto
  train transformer-pro transformer-pro
  train fox-llama fox-llama
  [ -n "${EXTRA_CMD:-}" ] && timeout ${EXTRA_LIMIT:-150} bash -c "$EXTRA_CMD" > "$R/extra.log" 2>&1
  gates_bench; gpu_tests
else
  ( export CUDA_VISIBLE_DEVICES=0; train fox-pro fox-pro; train fox-pro-acp fox-pro model.adaptive_threshold=auto
    gates_bench ) &
  ( export CUDA_VISIBLE_DEVICES=1; train fox-llama fox-llama; train transformer-pro transformer-pro; gpu_tests ) &
  wait
fi
tail -n 3 "$R"/*.log
tar -czf "$OUT/experiment.tar.gz" -C "$OUT" exp && rm -rf "$R"
if [ "${SKIP_SCALING:-0}" != 1 ]; then
  B="python3 benchmarks/bench_train.py --steps 5 --warmup 1 --configs fox-pro:760M:16384 --batch-tokens 32768"
  timeout $P0_LIMIT $B --mesh data=2 --out "$OUT/train_760m_2gpu_data.json" > "$OUT/scaling.log" 2>&1
  timeout $P0_LIMIT $B --mesh fsdp=2 --out "$OUT/train_760m_2gpu_fsdp.json" >> "$OUT/scaling.log" 2>&1
fi
