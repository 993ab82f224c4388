#!/bin/bash
# The round's host stages on a 2-core AMD EPYC VM with AVX-512 (benchmarks page, "The round's host stages on an
# EPYC with AVX-512"): the host replay at the H100 table, forward and reversed, at 1 and 4 slots; the host replay at
# this CPU's calibrated decode times; the real run at 1 and 4 slots; plain decoding against llama-cpp-python's
# generate loop at 1 slot. Every run writes its JSON to OUTDIR.
#   bash bench/results/2026-12-05-host-stages-avx512.sh OUTDIR
set -e
OUT=${1:?usage: $0 OUTDIR}
mkdir -p "$OUT"
D=ngram_mod,suffix,ngram_cache
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64"
for S in 1 4; do
  .venv/bin/specray bench $B --no-llama-baseline --slots $S --host-replay h100 \
      --configs none none@overlap $D $D@overlap --json "$OUT/replay-h100-s$S.json"
  .venv/bin/specray bench $B --no-llama-baseline --slots $S --host-replay h100 \
      --configs $D@overlap $D none@overlap none --json "$OUT/replay-h100-s$S-reversed.json"
  .venv/bin/specray bench $B --no-llama-baseline --slots $S --host-replay measured \
      --configs none $D --json "$OUT/replay-measured-s$S.json"
  .venv/bin/specray bench $B --no-llama-baseline --slots $S \
      --configs none none@overlap $D $D@overlap --json "$OUT/inplace-s$S.json"
done
.venv/bin/specray bench $B --slots 1 --configs none --json "$OUT/plain-vs-llama-s1.json"
