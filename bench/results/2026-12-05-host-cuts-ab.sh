#!/bin/bash
# The host cuts after the compiled look-ups (benchmarks page, "More compiled cores: ngram_mod, the estimates,
# suffix's pick"): `specray bench` of this checkout against BASE (the commit before them, built in a worktree of
# its own),
# interleaved: the host replay at the H100 table at 4 and then 1 slot, in the order after, before, after, before,
# after, before, with plain decoding and the n-gram chain, each with and without overlapped rounds; then the real
# run, 4 and then 1 slot, in the order before, after, before, after. BASE runs from the worktree's sources through
# PYTHONPATH, with the same venv.
#   bash bench/results/2026-12-05-host-cuts-ab.sh OUTDIR [BASE]
set -e
BASE_DEFAULT=c3e5b04
source bench/results/2026-12-05-base-worktree.sh "$@"  # OUT, BASE, ROOT, bench(), ab(), D, B
ab replay "after before after before after before" none none@overlap $D $D@overlap
ab inplace "before after before after" none $D
