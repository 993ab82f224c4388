#!/bin/bash
# The policy's learning from each round's verdicts moved into the next round's decode with overlapped rounds
# (benchmarks page, "Overlapped rounds: the verdicts learnt in the next decode"): `specray bench` of this checkout
# against BASE (the commit before, built in a worktree of its own), interleaved: the host replay at the H100 table
# at 4 and then 1 slot, in the order after, before, after, before, after, before, with plain decoding and the
# n-gram chain, each with and without overlapped rounds (without them nothing changed: the control); then the real
# run. BASE runs from the worktree's sources through PYTHONPATH, with the same venv.
#   bash bench/results/2026-12-05-overlap-verdicts-ab.sh OUTDIR [BASE]
set -e
OUT=${1:?usage: $0 OUTDIR [BASE]}
BASE=${2:-7cd4e26}
mkdir -p "$OUT"
ROOT=$(pwd)
source bench/results/2026-12-05-base-worktree.sh  # WT, PKG, bench(): BASE built in a worktree
D=ngram_mod,suffix,ngram_cache
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline"
for S in 4 1; do
  for v in after before after before after before; do
    bench $v $B --slots $S --host-replay h100 --configs none none@overlap $D $D@overlap \
      --json "$OUT/replay-s$S-$v-$(date +%H%M%S).json"
  done
done
# then a real run, 4 and then 1 slot, in the order before, after, before, after (on CPU the overlapped work runs on
# a helper thread while the round thread decodes)
for S in 4 1; do
  for v in before after before after; do
    bench $v $B --slots $S --configs none none@overlap $D $D@overlap \
      --json "$OUT/inplace-s$S-$v-$(date +%H%M%S).json"
  done
done
