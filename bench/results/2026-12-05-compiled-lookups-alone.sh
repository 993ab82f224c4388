#!/bin/bash
# The speculators alone, with the compiled look-ups and without (benchmarks page, "Compiled look-ups for ngram_cache
# and suffix"): bench/results/2026-12-05-compiled-cores.py run from this checkout and from BASE (the commit before
# them, built in a worktree of its own), alternately, three times each. Each run also times the references (every
# core off), which both commits share.
#   bash bench/results/2026-12-05-compiled-lookups-alone.sh OUTDIR [BASE]
set -e
BASE_DEFAULT=a41b35e
source bench/results/2026-12-05-base-worktree.sh "$@"  # OUT, BASE, ROOT, WT, PKG
SCRIPT=bench/results/2026-12-05-compiled-cores.py
for i in 1 2 3; do
  (cd /tmp && PYTHONPATH="$PKG" "$ROOT/.venv/bin/python" "$WT/$SCRIPT" "$OUT/before-$i.json")
  .venv/bin/python "$SCRIPT" "$OUT/after-$i.json"
done
