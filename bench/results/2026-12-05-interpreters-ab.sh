#!/bin/bash
# The same checkout under two Python interpreters (experiments page, "The round's host time in place, probed"):
# this checkout's .venv (A) against a venv made from OTHER_PYTHON (B) in OUTDIR/venv-b, with
# llama-cpp-python from the machine's wheel cache and this checkout installed editable. First two warm loops
# alone under each (A B A B); then `specray bench` in place at 4 and then 1 slot in the order A B B A, and the
# host replay at the H100 table in the order B A A B, with plain decoding and the n-gram chain, on the held-out
# categories; last, B's plain decoding against llama-cpp-python's generate loop at 1 slot. Each run's JSON into
# OUTDIR.
#   bash bench/results/2026-12-05-interpreters-ab.sh OUTDIR OTHER_PYTHON    # e.g. /usr/bin/python3.11
set -e
OUT=${1:?usage: $0 OUTDIR OTHER_PYTHON}
OTHER=${2:?usage: $0 OUTDIR OTHER_PYTHON}
mkdir -p "$OUT"
VB="$OUT/venv-b"
if [ ! -x "$VB/bin/python" ]; then
  "$OTHER" -m venv "$VB"
  "$VB/bin/python" -m pip install --quiet --upgrade pip
  "$VB/bin/python" -m pip install --quiet numpy typing-extensions diskcache jinja2
  bash scripts/build-llama-cpp.sh "$VB/bin/python"
  "$VB/bin/python" -m pip install --quiet -e .
  .venv/bin/python -m pip install --quiet --no-deps -e .  # the compiled cores rebuilt by A's interpreter
fi
for py in .venv/bin/python "$VB/bin/python"; do  # which interpreter, and whether it calls into a shared libpython
  echo "$py: $("$py" -c 'import sys, sysconfig; print(sys.version.split()[0], sysconfig.get_config_var("CONFIG_ARGS"))')"
  ldd "$py" | grep libpython || echo "  libpython linked into the executable"
done
for v in A B A B; do  # warm loops alone (2026-12-05-interpreter-loops.py)
  py=.venv/bin/python
  [ "$v" = B ] && py="$VB/bin/python"
  "$py" bench/results/2026-12-05-interpreter-loops.py "$OUT/loops-$v-$(date +%H%M%S%N).json"
done
D=ngram_mod,suffix,ngram_cache  # the n-gram chain
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline"
run() {  # run A|B KIND SLOTS [ARGS...]
  local py=.venv/bin/python
  [ "$1" = B ] && py="$VB/bin/python"
  "$py" -m specray.cli.main bench $B --slots "$3" "${@:4}" --configs none $D --json "$OUT/$2-s$3-$1-$(date +%H%M%S).json"
}
for S in 4 1; do for v in A B B A; do run $v inplace $S; done; done
for S in 4 1; do for v in B A A B; do run $v replay $S --host-replay h100; done; done
"$VB/bin/python" -m specray.cli.main bench --categories coding,math_reasoning,qa,rag,summarization,translation \
  --per-category 2 --max-tokens 64 --slots 1 --configs none --json "$OUT/plain-vs-llama-s1-B.json"
