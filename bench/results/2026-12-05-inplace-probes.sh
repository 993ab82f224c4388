#!/bin/bash
# The probes of 2026-12-05-inplace-probes.py against the control, interleaved (experiments page, "The round's host
# time in place, probed"): `specray bench` in place at 1 slot, plain decoding and the n-gram chain,
# held-out categories, in the order base, prefetch, hugepages, then reversed; then one run counting the garbage
# collector's collections; then base and objects, twice in the order base, objects, objects, base; then the host
# replay at the H100 table, 4 slots, base and objects-in-wait in the same order. Each run's bench JSON and probe
# JSON into OUTDIR.
#   bash bench/results/2026-12-05-inplace-probes.sh OUTDIR
set -e
OUT=${1:?usage: $0 OUTDIR}
mkdir -p "$OUT"
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline --slots 1 --configs none ngram_mod,suffix,ngram_cache"
for m in base prefetch hugepages hugepages prefetch base gc base objects objects base base objects objects base; do
  t=$(date +%H%M%S)
  .venv/bin/python bench/results/2026-12-05-inplace-probes.py $m "$OUT/$m-$t.probe.json" bench $B --json "$OUT/$m-$t.json"
done
R="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline --slots 4 --host-replay h100 --configs none ngram_mod,suffix,ngram_cache"
for m in base objects-in-wait objects-in-wait base base objects-in-wait objects-in-wait base; do
  t=$(date +%H%M%S)
  .venv/bin/python bench/results/2026-12-05-inplace-probes.py $m "$OUT/replay-$m-$t.probe.json" bench $R \
    --json "$OUT/replay-$m-$t.json"
done
