#!/bin/bash
# The host replay (H100 table), or with `inplace` a real run, with ngram_cache's module as at BEFORE (a dict for
# every n-gram) and as in the working tree (once-seen n-grams as ints), in the order after, before, after, before
# at 4 and then 1 slot (benchmarks page, "ngram_cache's once-seen n-grams as ints"). Only
# engine/speculators/ngram_cache.py differs between the runs: the script swaps it and puts the working tree's back
# at the end.
#   bash bench/results/2026-12-05-ngram-cache-replay-ab.sh OUTDIR [BEFORE_COMMIT [inplace]]
set -e
OUT=${1:?usage: $0 OUTDIR [BEFORE_COMMIT [inplace]]}
BEFORE=${2:-5291aee}
REPLAY="--host-replay h100"
[ "${3:-}" = inplace ] && REPLAY=""
mkdir -p "$OUT"
M=engine/speculators/ngram_cache.py
after=$(mktemp); before=$(mktemp)
cp $M "$after"
git show "$BEFORE:$M" > "$before"
trap 'cp "$after" $M' EXIT
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline $REPLAY --configs none ngram_mod,suffix,ngram_cache"
for S in 4 1; do
  for v in after before after before; do
    if [ $v = before ]; then cp "$before" $M; else cp "$after" $M; fi
    .venv/bin/specray bench $B --slots $S --json "$OUT/s$S-$v-$(date +%H%M%S).json"
  done
done
