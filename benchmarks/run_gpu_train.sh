#!/usr/bin/env bash
# One H200 call: install the carried wheels, then pretrain a 125M FoX (LLaMA) on the pre-tokenized
# Gutenberg corpus for a few minutes and evaluate it. Usage (device machine, repo root):
#   bash benchmarks/run_gpu_train.sh STEPS [extra key=value overrides]
# Needs: .whl/ (grain, array_record, portpicker, tensorboardX wheels for Python 3.12) and
# .gpu/gutenberg (python -m fox_jax.train.data .gpu/gutenberg --data ../shared/data/corpus
#   --val-data ../shared/data/corpus_val --tokenizer ../shared/data/tokenizers/gpt2).
set -euo pipefail
STEPS=${1:-300}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
WD=/tmp/fox125m
python3 -m fox_jax.train.cli train --preset 125M --arch fox-llama --data .gpu/gutenberg --tokenizer .gpu/gutenberg/tokenizer \
  --workdir $WD --steps "$STEPS" --seq-len 2048 --batch-size 32 --no-progress \
  eval_every=100 eval_batches=16 log_every=10 ckpt_every=0 optim.warmup_steps=50 "$@" 2>&1 | tee "$OUT/train_125m.log"
python3 -m fox_jax.train.cli eval --workdir $WD --num-docs 16 2>&1 | tee "$OUT/eval_125m.log"
cp $WD/metrics.jsonl "$OUT/metrics_125m.jsonl"; cp $WD/eval/*.json $WD/eval/*.png "$OUT/" ; cp $WD/config.json "$OUT/config_125m.json"
