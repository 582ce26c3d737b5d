#!/usr/bin/env bash
# One call on the 2-GPU machine (nvidia-h200-x2): training throughput for issue 4.
#   phase A (in parallel): GPU 0 — 760M FoX (Pro) at 16k, ACP off/on, then 760M Transformer (Pro);
#                          GPU 1 — 125M FoX (Pro) / Transformer (Pro) at 2k/8k/16k, ACP off/on;
#   phase B (both GPUs):   760M FoX (Pro) at 16k on data=2 and on fsdp=2 (16k tokens per GPU: weak scaling).
# Rows are printed (and saved) as they finish, so a phase cut by its time limit keeps what it measured.
# Usage (repo root of the device machine, wheels in .whl/): bash benchmarks/run_gpu_bench_train.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A_LIMIT=${A_LIMIT:-300}; B_LIMIT=${B_LIMIT:-230}
export PYTHONUNBUFFERED=1
B="python3 benchmarks/bench_train.py --steps 5 --warmup 1"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
( CUDA_VISIBLE_DEVICES=0 timeout $A_LIMIT $B --configs fox-pro:760M:16384 --acp both --batch-tokens 16384 \
    --out "$OUT/train_760m_1gpu.json" > "$OUT/train_760m_1gpu.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 60 $B --configs transformer-pro:760M:16384 --batch-tokens 16384 \
    --out "$OUT/train_760m_tr_1gpu.json" >> "$OUT/train_760m_1gpu.log" 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout $A_LIMIT $B --configs fox-pro:125M:2048 fox-pro:125M:8192 fox-pro:125M:16384 \
    transformer-pro:125M:2048 transformer-pro:125M:8192 --acp both --batch-tokens 65536 \
    --out "$OUT/train_125m_1gpu.json" > "$OUT/train_125m_1gpu.log" 2>&1 ) &
wait
timeout $B_LIMIT $B --configs fox-pro:760M:16384 --batch-tokens 32768 --mesh data=2 \
  --out "$OUT/train_760m_2gpu_data.json" > "$OUT/train_760m_2gpu.log" 2>&1
timeout 100 $B --configs fox-pro:760M:16384 --batch-tokens 32768 --mesh fsdp=2 \
  --out "$OUT/train_760m_2gpu_fsdp.json" >> "$OUT/train_760m_2gpu.log" 2>&1
grep -h '^{' "$OUT"/*.log
