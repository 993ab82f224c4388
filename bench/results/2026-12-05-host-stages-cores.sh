#!/bin/bash
# The round's host stages with the compiled cores (benchmarks page, "Compiled cores for suffix's trie and
# ngram_cache's counts"): the host replay at the H100 table, forward and reversed, at 4 and 1 slots, with and
# without overlapped rounds; then the real run at 4 and 1 slots. Every run writes its JSON to OUTDIR.
#   bash bench/results/2026-12-05-host-stages-cores.sh OUTDIR
set -e
OUT=${1:?usage: $0 OUTDIR}
mkdir -p "$OUT"
D=ngram_mod,suffix,ngram_cache
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64"
for S in 4 1; do
  .venv/bin/specray bench $B --no-llama-baseline --slots $S --host-replay h100 \
      --configs none none@overlap $D $D@overlap --json "$OUT/replay-h100-s$S.json"
  .venv/bin/specray bench $B --no-llama-baseline --slots $S --host-replay h100 \
      --configs $D@overlap $D none@overlap none --json "$OUT/replay-h100-s$S-reversed.json"
done
for S in 4 1; do
  .venv/bin/specray bench $B --no-llama-baseline --slots $S \
      --configs none none@overlap $D $D@overlap --json "$OUT/inplace-s$S.json"
done
