#!/usr/bin/env bash
# One H200 call: the GPU tests, then the attention and DCP-attention benchmarks of this tree next to an
# earlier tree (same command, same machine), to check that a change keeps the kernels' speed.
# Usage (device machine, repo root):  bash benchmarks/run_gpu_check.sh [PREV_TREE]
# PREV_TREE (default .gpu/prev) holds fox_jax/, kernels/ and benchmarks/ of the earlier commit, e.g.
#   mkdir -p .gpu/prev && git archive REV fox_jax kernels benchmarks | tar -x -C .gpu/prev
set -uo pipefail
PREV=${1:-.gpu/prev}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SHAPES=4x4096x32x64,8x2048x16x128,2x8192x16x128,1x16384x16x128,1x16384x24x64
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -m gpu tests/test_pallas.py tests/test_dcp_pallas.py -p no:cacheprovider \
  2>&1 | tail -n 25 | tee "$OUT/gpu_tests.log"
for tree in "$PREV" .; do
  tag=$([ "$tree" = . ] && echo new || echo prev)
  (cd "$tree" && timeout 150 python3 benchmarks/bench_attention.py --impls cudnn,pallas,pallas-acp --shapes $SHAPES \
     --out "$OUT/attention_$tag.json" 2>&1 | grep -v Deprecat | tail -n 12)
done
for tree in "$PREV" .; do
  tag=$([ "$tree" = . ] && echo new || echo prev)
  (cd "$tree" && timeout 90 python3 benchmarks/bench_dcp.py --out "$OUT/dcp_$tag.json" 2>&1 | grep -v Deprecat | tail -n 10)
done
