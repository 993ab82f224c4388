#!/bin/bash
# The round's host stages after the compiled look-ups (benchmarks page, "Compiled look-ups for ngram_cache and
# suffix"): the host replay at the H100 table, plain decoding and the n-gram chain, each with and without
# overlapped rounds, in alternating orders: six runs at 4 slots, four at 1 slot. Every run writes its JSON to OUTDIR.
#   bash bench/results/2026-12-05-host-stages-lookups.sh OUTDIR
set -e
OUT=${1:?usage: $0 OUTDIR}
mkdir -p "$OUT"
D=ngram_mod,suffix,ngram_cache
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline --host-replay h100"
for S in 4 1; do
  n=$([ $S = 4 ] && echo 3 || echo 2)
  for i in $(seq $n); do
    .venv/bin/specray bench $B --slots $S --configs none none@overlap $D $D@overlap --json "$OUT/s$S-forward-$i.json"
    .venv/bin/specray bench $B --slots $S --configs $D@overlap $D none@overlap none --json "$OUT/s$S-reversed-$i.json"
  done
done
