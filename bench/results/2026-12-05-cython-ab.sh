#!/usr/bin/env bash
# The engine's hot modules compiled with Cython (pure-Python mode: the unchanged .py sources, no type
# declarations) against the same sources interpreted: the in-place round stages (`specray bench`, held-out
# categories) in the order interpreted, compiled, interpreted, compiled at 1 and 4 slots, then the host replay
# (H100 table) interpreted and compiled. The compiled modules are built next to their sources and removed
# again between runs and at the end (Python imports an extension module before a .py of the same name).
# Run from the repository root: bash bench/results/2026-12-05-cython-ab.sh OUTDIR
set -euo pipefail
out=${1:?usage: bash bench/results/2026-12-05-cython-ab.sh OUTDIR}
mkdir -p "$out/so"
.venv/bin/pip install -q cython==3.3.1
MODS="engine/scheduler.py engine/target.py engine/verify.py engine/cost.py engine/request.py engine/chain.py
engine/speculator.py engine/round_stages.py engine/policy/*.py engine/speculators/_util.py engine/speculators/ngram_mod.py
engine/speculators/suffix.py engine/speculators/ngram_cache.py engine/prefix_cache.py engine/rollback.py
engine/sampling.py native/batch.py native/context.py deployments/local_engine.py"
# shellcheck disable=SC2086
.venv/bin/cythonize -i -j 2 -X language_level=3 -X annotation_typing=False -X binding=True $MODS
find engine native deployments -name "*.so" -exec cp --parents {} "$out/so/" \;
off() { find engine native deployments -name "*.so" -delete; }
on() { (cd "$out/so" && find . -name "*.so" -exec cp --parents {} "$OLDPWD/" \;); }
trap 'off; for m in $MODS; do rm -f "${m%.py}.c"; done' EXIT
CATS=coding,math_reasoning,qa,rag,summarization,translation
place() { .venv/bin/specray bench --configs none ngram_mod,suffix,ngram_cache --categories $CATS --per-category 2 \
    --max-tokens 64 --no-llama-baseline --slots "$2" --json "$out/$1-s$2.json"; }
replay() { .venv/bin/specray bench --host-replay h100 --configs none ngram_mod,suffix,ngram_cache --categories $CATS \
    --per-category 2 --max-tokens 64 --slots "$2" --json "$out/replay-$1-s$2.json"; }
for s in 1 4; do off; place pure-a $s; on; place cython-a $s; off; place pure-b $s; on; place cython-b $s; done
for s in 1 4; do off; replay pure-a $s; on; replay cython-a $s; done
