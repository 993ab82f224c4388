#!/bin/bash
# The speculators and the estimates alone, before and after the host cuts (benchmarks page, "More compiled cores:
# ngram_mod, the estimates, suffix's pick"): bench/results/2026-12-05-compiled-cores.py run from BASE (the commit
# before them, built in a worktree of its own; its script has no ngram_mod) and from this checkout (which adds
# ngram_mod's core against its reference), alternately, twice each; then 2026-12-05-estimate-alone.py.
#   bash bench/results/2026-12-05-host-cuts-alone.sh OUTDIR [BASE]
set -e
BASE_DEFAULT=c3e5b04
source bench/results/2026-12-05-base-worktree.sh "$@"  # OUT, BASE, ROOT, WT, PKG
SCRIPT=bench/results/2026-12-05-compiled-cores.py
for i in 1 2; do
  (cd /tmp && PYTHONPATH="$PKG" "$ROOT/.venv/bin/python" "$WT/$SCRIPT" "$OUT/before-$i.json")
  .venv/bin/python "$SCRIPT" "$OUT/after-$i.json"
done
.venv/bin/python bench/results/2026-12-05-estimate-alone.py "$OUT/estimate.json"
