#!/usr/bin/env bash
# One H200 call: this tree next to an earlier tree (same command, same machine), to check that a change
# keeps the speed.
#   kernels  (default): the GPU tests, then the attention and DCP-attention benchmarks of both trees.
#   training: training-step throughput (benchmarks/bench_train.py) and the end-to-end commands
#             pretrain-gpt2 -> finetune-dcp (tokens/s from metrics.jsonl) of both trees. Needs grain wheels in
#             .whl/ and text + GPT-2 tokenizer files in .gpu/data/ ({train,val}.txt, tok/).
# Usage (device machine, repo root):  bash benchmarks/run_gpu_check.sh [PREV_TREE] [kernels|training]
# PREV_TREE (default .gpu/prev) holds fox_jax/, kernels/, train/ and benchmarks/ of the earlier commit, e.g.
#   mkdir -p .gpu/prev && git archive REV fox_jax kernels train benchmarks | tar -x -C .gpu/prev
set -uo pipefail
PREV=${1:-.gpu/prev}
MODE=${2:-kernels}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$PWD
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
tag_of() { [ "$1" = . ] && echo new || echo prev; }

if [ "$MODE" = kernels ]; then
  SHAPES=4x4096x32x64,8x2048x16x128,2x8192x16x128,1x16384x16x128,1x16384x24x64
  PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -m gpu tests/test_pallas.py tests/test_dcp_pallas.py -p no:cacheprovider \
    2>&1 | tail -n 25 | tee "$OUT/gpu_tests.log"
  for tree in "$PREV" .; do
    tag=$(tag_of "$tree")
    (cd "$tree" && timeout 150 python3 benchmarks/bench_attention.py --impls cudnn,pallas,pallas-acp --shapes $SHAPES \
       --out "$OUT/attention_$tag.json" 2>&1 | grep -v Deprecat | tail -n 12)
  done
  for tree in "$PREV" .; do
    tag=$(tag_of "$tree")
    (cd "$tree" && timeout 150 python3 benchmarks/bench_dcp.py ${DCP_SHAPES:+--shapes $DCP_SHAPES} --out "$OUT/dcp_$tag.json" 2>&1 | grep -v Deprecat | tail -n 10)
  done
  exit 0
fi

python3 -m pip install -q --no-deps --target /tmp/wheels .whl/*.whl 2>&1 | tail -n 2
export PYTHONPATH=/tmp/wheels
python3 -c "import grain; print('grain', grain.__version__ if hasattr(grain, '__version__') else 'ok')"
D=$ROOT/.gpu/data
STEPS=${STEPS:-30}
for tree in "$PREV" .; do
  tag=$(tag_of "$tree")
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/wheels timeout 150 python3 benchmarks/bench_train.py --configs ${TRAIN_CONFIGS:-fox-pro:125M:2048 transformer-pro:125M:2048} \
     --batch-tokens 32768 --steps 8 --warmup 2 --out "$OUT/train_$tag.json" 2>&1 | grep -v Deprecat | tail -n 4)
done
for tree in "$PREV" .; do
  tag=$(tag_of "$tree")
  W=/tmp/runs_$tag; rm -rf "$W"
  (cd "$tree" && export PYTHONPATH=$PWD:/tmp/wheels
   timeout 150 python3 -m fox_jax.train.cli pretrain-gpt2 --workdir "$W/pre" --data "$D/train.txt" --val-data "$D/val.txt" \
     --tokenizer "$D/tok" --seq-len 1024 --batch-size 8 --steps "$STEPS" --dtype bfloat16 --eval-every 0 \
     --eval-batches 2 --ckpt-every 0 --log-every 1 --no-progress > "$OUT/pretrain_$tag.log" 2>&1
   timeout 150 python3 -m fox_jax.train.cli finetune-dcp --hf-gpt2 "$W/pre/hf" --workdir "$W/dcp" --data "$D/train.txt" \
     --val-data "$D/val.txt" --tokenizer "$D/tok" --batch-size 8 --steps "$STEPS" --dtype bfloat16 --eval-every 0 \
     --eval-batches 2 --ckpt-every 0 --log-every 1 --no-progress > "$OUT/finetune_$tag.log" 2>&1
   for run in pre dcp; do
     python3 - "$W/$run/metrics.jsonl" "$tag" "$run" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r][2:]  # drop compile/warm-up steps
print(json.dumps({"tree": sys.argv[2], "run": sys.argv[3], "steps": len(rates),
                  "median_tokens_per_sec": statistics.median(rates) if rates else None}))
PY
   done) | tee -a "$OUT/e2e.jsonl"
done
