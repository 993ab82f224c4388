#!/bin/bash
# The policy's learning from each round's verdicts moved into the next round's decode with overlapped rounds
# (benchmarks page, "Overlapped rounds: the verdicts learnt in the next decode"): `specray bench` of this checkout
# against BASE (the commit before, built in a worktree of its own), interleaved: the host replay at the H100 table
# at 4 and then 1 slot, in the order after, before, after, before, after, before, with plain decoding and the
# n-gram chain, each with and without overlapped rounds (without them nothing changed: the control); then the real
# run. BASE runs from the worktree's sources through PYTHONPATH, with the same venv.
#   bash bench/results/2026-12-05-overlap-verdicts-ab.sh OUTDIR [BASE]
set -e
BASE_DEFAULT=7cd4e26
source bench/results/2026-12-05-base-worktree.sh "$@"  # OUT, BASE, ROOT, bench(), ab(), D, B
ab replay "after before after before after before" none none@overlap $D $D@overlap
# then a real run (on CPU the overlapped work runs on a helper thread while the round thread decodes)
ab inplace "before after before after" none none@overlap $D $D@overlap
