#!/bin/bash
# The round's host stages with the compiled cores (suffix's SuffixTrie.extend, ngram_cache's NgramCountTable.update
# and .merge) and with their pure-Python references (benchmarks page, "Compiled cores for suffix's trie and
# ngram_cache's counts"): `specray bench` run with the cores on and off in the order on, off, on, off, at 4 and
# then 1 slot. The host replay at the H100 table, or with `inplace` a real run. Nothing else differs between the
# runs: each starts specray bench in a Python that has set the speculators' `compiled` switch first.
#   bash bench/results/2026-12-05-compiled-cores-ab.sh OUTDIR [inplace]
set -e
OUT=${1:?usage: $0 OUTDIR [inplace]}
REPLAY="--host-replay h100"
[ "${2:-}" = inplace ] && REPLAY=""
mkdir -p "$OUT"
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline $REPLAY --configs none ngram_mod,suffix,ngram_cache"
bench() {  # bench on|off ARGS...: specray bench with the compiled cores on or off
  .venv/bin/python - "$@" <<'PY'
import sys
from specray.cli.main import main
from specray.engine.speculators.ngram_cache import COMPILED_CORE as NGRAM_BUILT, NgramCountTable
from specray.engine.speculators.suffix import COMPILED_CORE as SUFFIX_BUILT, SuffixTrie
assert NGRAM_BUILT and SUFFIX_BUILT, "the compiled cores are not built: pip install -e ."
NgramCountTable.compiled = SuffixTrie.compiled = sys.argv[1] == "on"
sys.exit(main(["bench", *sys.argv[2:]]))
PY
}
for S in 4 1; do
  for v in on off on off; do
    bench $v $B --slots $S --json "$OUT/s$S-$v-$(date +%H%M%S).json"
  done
done
