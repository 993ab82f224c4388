#!/bin/bash
# The floor under a plain round's host time against the engine's rounds, in one hour (experiments page, "The floor
# under a plain round's host time"): twice, 2026-12-05-floor-loop.py (1 and 4 slots, after a real decode, after a
# spin as long, after a spin of the H100 table), then `specray bench` at 1 and 4 slots, plain decoding and the
# n-gram chain on the held-out categories, in place and in the host replay at the H100 table. JSON into OUTDIR.
#   bash bench/results/2026-12-05-floor-loop.sh OUTDIR
set -e
OUT=${1:?usage: $0 OUTDIR}
mkdir -p "$OUT"
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline --configs none ngram_mod,suffix,ngram_cache"
for pass in 1 2; do
  .venv/bin/python bench/results/2026-12-05-floor-loop.py "$OUT/floor-$pass.json"
  for S in 1 4; do
    .venv/bin/specray bench $B --slots $S --json "$OUT/inplace-s$S-$pass.json"
    .venv/bin/specray bench $B --slots $S --host-replay h100 --json "$OUT/replay-s$S-$pass.json"
  done
done
