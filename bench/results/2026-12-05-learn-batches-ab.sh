#!/bin/bash
# Rounds learnt eight at a time without overlapped rounds, the logits' address read without a pointer object,
# one-row runs written with item writes and the verification's slices skipped (benchmarks page, "Learning in
# batches, and what a call costs after a decode"):
# `specray bench` of this checkout against BASE (the commit before, built in a worktree of its own), interleaved:
# real runs at 4 and then 1 slot in the order before, after, before, after, with plain decoding and the n-gram
# chain; then the host replay at the H100 table in the order after, before, after, before. BASE runs from the
# worktree's sources through PYTHONPATH, with the same venv.
#   bash bench/results/2026-12-05-learn-batches-ab.sh OUTDIR [BASE]
set -e
BASE_DEFAULT=95025f9
source bench/results/2026-12-05-base-worktree.sh "$@"  # OUT, BASE, ROOT, bench(), ab(), D, B
ab inplace "before after before after" none $D
ab replay "after before after before" none $D
