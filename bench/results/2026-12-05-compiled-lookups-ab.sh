#!/bin/bash
# The compiled look-ups (benchmarks page, "Compiled look-ups for ngram_cache and suffix"): `specray bench` of this
# checkout against BASE (the commit before them, built in a worktree of its own), interleaved: at 4 and then 1 slot,
# the host replay at the H100 table in the order after, before, after, before; then the real run in the order
# before, after, before, after. BASE runs from the worktree's sources through PYTHONPATH, with the same venv.
#   bash bench/results/2026-12-05-compiled-lookups-ab.sh OUTDIR [BASE]
set -e
BASE_DEFAULT=a41b35e
source bench/results/2026-12-05-base-worktree.sh "$@"  # OUT, BASE, ROOT, bench(), ab(), D, B
ab replay "after before after before" none $D $D@overlap
ab inplace "before after before after" none $D
