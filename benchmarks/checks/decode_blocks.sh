#!/usr/bin/env bash
# Decode blocks of K steps (generate's steps_per_check) against a check every step (K = 1), one call, one card:
# FoX (Pro) 125M B8 8192 + 128 and GPT-2 124M B32 896 + 128 at equal batch (bench_decode.py rows, issue 20).
#   bash benchmarks/checks/decode_blocks.sh        # device machine, repo root; carry [".whl"]; ~8 min
# Writes $OUT/blocks_<part><rep>_k<K>.json (bench_decode's issue rows) and a summary line per row.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import grain" 2>/dev/null || { python3 -m pip install -q --no-deps --target /tmp/wheels .whl/*.whl; }
export PYTHONPATH=.:/tmp/wheels PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # model-args name k policies
  timeout -k 5 "${T_ROW:-200}" python3 benchmarks/bench_decode.py $1 --policies "$4" --new-tokens 128 --repeats 5 \
    --steps-per-check "$3" --out "$OUT/full_$2_k$3.json" --rows-out "$OUT/blocks_$2_k$3.json" > "$OUT/$2_k$3.log" 2>&1
  python3 - "$OUT/blocks_$2_k$3.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"{r['model']:>14} K={r.get('steps_per_check')} {r['policy']:>11} B{r['batch']} {r['prompt']}: "
          f"{r.get('ms_per_step') or 0:.4f} ms/step, prefill {r.get('prefill_s') or 0:.4f} s, {r.get('decode_tokens_per_s') or 0:.0f} tok/s")
PY
}
FOX="--model fox-pro:125M --model-name fox-pro-125M --prompt-lengths 8192 --equal-batch 8"
GPT="--model gpt2 --model-name gpt2-124M --prompt-lengths 896 --equal-batch 32"
# PARTS: fox, gpt2 (both by default); REPS > 1 repeats each part (fresh processes: compiles and autotuning again)
for rep in $(seq "${REPS:-1}"); do
  for part in ${PARTS:-fox gpt2}; do
    for k in ${KS:-8 1}; do
      case $part in
        fox) run "$FOX" "fox$rep" "$k" "${FOX_POLICIES:-dense,acp,window:256}" ;;
        gpt2) run "$GPT" "gpt2$rep" "$k" "${GPT_POLICIES:-dense}" ;;
      esac
    done
  done
done
