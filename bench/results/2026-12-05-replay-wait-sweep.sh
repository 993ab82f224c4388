#!/bin/bash
# The host replay at four step tables (benchmarks page, "Host work after a wait"): the H100 table, a 1B-class
# target's (3x), 10 ms and 25 ms (about a CPU decode of SmolLM2 here). The wait is a spin in every case. Each slot
# count runs the tables in ascending and then descending order; 2026-12-05-replay-wait-sweep.json holds every
# run's replay results in the order they ran.
#   bash bench/results/2026-12-05-replay-wait-sweep.sh OUTDIR
set -e
OUT=${1:?usage: $0 OUTDIR}
mkdir -p "$OUT"
B="--configs none ngram_mod,suffix,ngram_cache --categories coding,math_reasoning,qa,rag,summarization,translation
   --per-category 2 --max-tokens 64 --no-llama-baseline"
T=(h100 1:4.8,8:7.5 1:10,8:12 1:25,8:30)
for S in 1 4; do
  for order in "0 1 2 3" "3 2 1 0"; do
    for i in $order; do
      .venv/bin/specray bench $B --slots $S --host-replay "${T[$i]}" --json "$OUT/s$S-t$i-$(date +%H%M%S).json"
    done
  done
done
