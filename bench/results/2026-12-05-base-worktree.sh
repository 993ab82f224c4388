# Sourced, with the script's own arguments (OUTDIR [BASE]), by the before/after scripts (2026-12-05-*-ab.sh,
# 2026-12-05-*-alone.sh), each of which sets BASE_DEFAULT, the commit it compares against: OUT (made) and BASE from
# those arguments, ROOT this checkout; BASE checked out in a worktree of its own, its compiled cores built there,
# and $PKG a folder whose `specray` package is that worktree's sources (PYTHONPATH="$PKG" runs BASE with this
# checkout's venv). Both go at exit. `bench before|after ARGS...` runs `specray bench ARGS...` from BASE or from
# this checkout; `ab replay|inplace "ORDER" CONFIGS...` runs CONFIGS at 4 and then 1 slot, once per word of ORDER
# (before/after), on the held-out categories (B), each run's JSON into $OUT.
OUT=${1:?usage: $0 OUTDIR [BASE]}
BASE=${2:-$BASE_DEFAULT}
mkdir -p "$OUT"
ROOT=$(pwd)
WT=$(mktemp -d)/base
git worktree add --detach "$WT" "$BASE" >/dev/null
(cd "$WT" && "$ROOT/.venv/bin/python" setup.py -q build_ext --inplace >/dev/null 2>&1)
PKG=$(mktemp -d)
mkdir "$PKG/specray"
for d in engine native deployments cluster bench cli train; do ln -s "$WT/$d" "$PKG/specray/$d"; done
trap 'git worktree remove --force "$WT"; rm -rf "$PKG"' EXIT
bench() {  # bench before|after ARGS...
  if [ "$1" = before ]; then
    (cd /tmp && PYTHONPATH="$PKG" "$ROOT/.venv/bin/python" -c \
      'import sys, specray.cli.main as m; assert m.__file__.startswith(sys.argv[1]); sys.exit(m.main(sys.argv[2:]))' \
      "$PKG" bench "${@:2}")
  else
    .venv/bin/specray bench "${@:2}"
  fi
}
D=ngram_mod,suffix,ngram_cache  # the n-gram chain
B="--categories coding,math_reasoning,qa,rag,summarization,translation --per-category 2 --max-tokens 64
   --no-llama-baseline"
ab() {  # ab replay|inplace "ORDER" CONFIGS...: replay at the H100 table, or a real run
  local kind=$1 order=$2 S v
  shift 2
  local table=()
  [ "$kind" = replay ] && table=(--host-replay h100)
  for S in 4 1; do
    for v in $order; do
      bench $v $B --slots $S "${table[@]}" --configs "$@" --json "$OUT/$kind-s$S-$v-$(date +%H%M%S).json"
    done
  done
}
