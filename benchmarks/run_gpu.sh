#!/usr/bin/env bash
# One H200 call for the Mosaic GPU forward (issue 13): a smoke check, the GPU tests, a forward tiling sweep and
# the side-by-side attention benchmark (cuDNN jax + torch, our Triton and Mosaic paths, the official FoX Triton
# kernel, dense and ACP). Needs the official kernel's copy in .gpu/fox_triton/ (benchmark-only; gitignored) and,
# for the profile stage, grain's wheels in .whl/:
#   mkdir -p .gpu/fox_triton && cp ../shared/anchors/fox_triton/{forgetting_attention.py,LICENSE} .gpu/fox_triton/
# Then the DCP attention benchmark (compacted live-tile lists) and a profiled 760M training step (Triton vs Mosaic
# attention, padded vocabulary + chunked cross-entropy). Each stage has its own time limit (*_S variables).
# Usage (device machine, repo root): bash benchmarks/run_gpu_mosaic.sh   (STAGES="smoke tests sweep bench dcp profile")
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
STAGES=${STAGES:-"smoke tests sweep bench dcp profile"}  # and "train" (the training table; its own call)
SHAPES=${SHAPES:-4x4096x32x64,8x2048x16x128,2x8192x16x128,1x16384x16x128,1x16384x24x64}
SWEEP=${SWEEP:-64x128x3x64x64x2,64x128x3x64x64x3,64x128x3x128x64x2,64x128x3x0x64x2}
IMPLS=${IMPLS:-cudnn,torch-cudnn,pallas,mosaic,mosaic-triton-bwd,fox-triton,fla,pallas-acp,mosaic-acp,fox-triton-acp}
if [[ " $STAGES " == *" profile "* || " $STAGES " == *" train "* ]]; then  # the training stack imports grain: carry its wheels in .whl/
  python3 -m pip install -q --no-deps --target /tmp/wheels .whl/*.whl 2>&1 | tail -n 2
  export PYTHONPATH=$PWD:/tmp/wheels
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
for s in $STAGES; do
  case $s in
    smoke) timeout ${SMOKE_S:-90} python3 .gpu/mosaic_smoke.py 2>&1 | grep -v -i deprecat | tail -n 20 | tee "$OUT/mosaic_smoke.log" ;;
    tests) timeout ${TESTS_S:-240} python3 -m pytest -q -m gpu ${TEST_FILES:-tests/test_mosaic.py} -p no:cacheprovider 2>&1 \
             | tail -n 30 | tee "$OUT/gpu_tests_mosaic.log" ;;
    sweep) timeout ${SWEEP_S:-120} python3 benchmarks/bench_attention.py --mosaic-sweep $SWEEP \
             --shapes ${SWEEP_SHAPES:-1x16384x24x64,1x16384x16x128} --impls "" --out "$OUT/mosaic_sweep.json" 2>&1 \
             | grep "mosaic sweep" | tee "$OUT/mosaic_sweep.log" ;;
    dcp) timeout ${DCP_S:-140} python3 benchmarks/bench_dcp.py --no-xla --all-masked \
             --shapes ${DCP_SHAPES:-8x1024x12x64,4x2048x16x128,1x8192x16x128} --sparsities 0.5,0.9 \
             --out "$OUT/dcp_lists.json" 2>&1 | grep -v -i deprecat | tail -n 30 | tee "$OUT/dcp_lists.log" ;;
    profile) timeout ${PROFILE_S:-400} python3 benchmarks/profile_step.py --configs ${PROFILE_CONFIGS:-fox-pro:760M:16384} \
             --batch-tokens 16384 --steps 3 --warmup 2 --variants ${PROFILE_VARIANTS:-\
             triton:attention_impl=pallas,vocab_pad_multiple=1,loss_impl=logits \
             mosaic:attention_impl=mosaic,vocab_pad_multiple=1,loss_impl=logits \
             mosaic-pad-chunked:attention_impl=mosaic,vocab_pad_multiple=128,loss_impl=chunked} \
             --out "$OUT/profile_step.json" 2>&1 | grep -v -i deprecat | tail -n 80 | tee "$OUT/profile_step.log" ;;
    train) # the training table, one row per (config, ACP): Mosaic (auto on Hopper) and, with TRAIN_OVERRIDES,
           # e.g. attention_impl=pallas for the Triton kernels; split TRAIN_CONFIGS over calls (~45-130 s per compile)
           timeout ${TRAIN_S:-540} python3 benchmarks/bench_train.py --configs ${TRAIN_CONFIGS:-fox-pro:760M:16384 \
             fox-pro:760M:2048 fox-llama:760M:16384 transformer-pro:760M:16384} --acp both --batch-tokens 16384 \
             --steps 5 --warmup 1 --overrides "${TRAIN_OVERRIDES:-}" --out "$OUT/train_table.json" 2>&1 \
             | grep -v -i deprecat | tail -n 30 | tee "$OUT/train_table.log" ;;
    bench) timeout ${BENCH_S:-330} python3 benchmarks/bench_attention.py --impls $IMPLS --shapes $SHAPES \
             --fox-triton .gpu/fox_triton --out "$OUT/attention_mosaic.json" 2>&1 | grep -v -i deprecat \
             | tail -n 40 | tee "$OUT/attention_mosaic.log" ;;
  esac
done
