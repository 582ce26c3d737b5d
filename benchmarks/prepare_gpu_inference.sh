#!/usr/bin/env bash
# Builds the data folder that benchmarks/run_gpu_inference.sh carries to the GPU machine (an ignored path, so
# name it in the run's carry list together with .whl/):
#   $DATA_DIR/train_tok/   the first TRAIN_MB MB of the Gutenberg training shards, pre-tokenized with GPT-2 BPE
#                          (python -m fox_jax.train.data: train.npy, val.npy = all of corpus_val, tokenizer/)
#   $DATA_DIR/val.txt      VAL_MB MB of corpus_val (the passkey haystack; validation text for the .txt layout)
#   $DATA_DIR/tok/         GPT-2 vocab.json + merges.txt
#   $DATA_DIR/long/        the four long novels (FoX evaluation at 2k-16k)
# About 25 + 1 + 1.3 + 7 MB for TRAIN_MB=48 (the carry limit is 64 MiB, wheels included).
# Usage (repo root, CPU machine): bash benchmarks/prepare_gpu_inference.sh   [SHARED=../shared/data TRAIN_MB=48]
set -euo pipefail
SHARED=${SHARED:-$PWD/../shared/data}; [ -d "$SHARED" ] || SHARED=/work/shared/data
DATA_DIR=${DATA_DIR:-$PWD/.gpu/data}; TRAIN_MB=${TRAIN_MB:-48}; VAL_MB=${VAL_MB:-1}
mkdir -p "$DATA_DIR/long" "$DATA_DIR/tok"
cp "$SHARED"/tokenizers/gpt2/vocab.json "$SHARED"/tokenizers/gpt2/merges.txt "$DATA_DIR/tok/"
cp "$SHARED"/long/*.txt "$DATA_DIR/long/"
head -c $((VAL_MB * 1000000)) "$SHARED"/corpus_val/gutenberg_val.txt > "$DATA_DIR/val.txt"
STAGE=$(mktemp -d); trap 'rm -rf "$STAGE"' EXIT
(set +o pipefail; cat "$SHARED"/corpus/gutenberg_train_0*.txt | head -c $((TRAIN_MB * 1000000)) > "$STAGE/train.txt")
rm -rf "$DATA_DIR/train_tok"
python3 -m fox_jax.train.data "$DATA_DIR/train_tok" --data "$STAGE/train.txt" --val-data "$SHARED/corpus_val" \
  --tokenizer "$DATA_DIR/tok"
du -sh "$DATA_DIR"/*
