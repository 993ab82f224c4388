#!/usr/bin/env bash
# The measurements a lent GPU machine is for, in order of value, each writing into $OUT as it goes (a run
# cut off by its time limit still returns what finished). Run on the GPU machine after the offline recipe
# (../shared/gpu/README.md: prepare.sh here, gpu-setup.sh there), in the checkout:
#   source /tmp/gpu/env.sh && OUT=/some/dir bash scripts/gpu-measure.sh [quick]
# `quick`: 1 slot only (the shape-stable verdict and the round breakdown), then llama-server.
# `pricing`: only the default chain against plain decoding at 1 and 4 slots, exact shapes and one padded shape
# (--verify-buckets 4: every round 4 rows a sequence, drafts of at most 3), one text file each.
# Needs: $SPECRAY_GPU_MODELS (the models), $LLAMA_SERVER (built from the same llama.cpp sources).
set -uo pipefail
OUT=${OUT:?set OUT to the folder for the results}
M=${MODEL:-$(ls "$SPECRAY_GPU_MODELS"/*.gguf | grep -i smol | head -1)}
CATS=${CATS:-coding,math,qa,rag,summarization,translation}
THREADS=${THREADS:-4}
MAX_TOKENS=${MAX_TOKENS:-128}  # a dry run elsewhere: MAX_TOKENS=8
mkdir -p "$OUT"
# Spec-Bench travels beside the parts (../shared does not): cp ../shared/data/spec_bench/question.jsonl .gpu/pN/
[ -f /tmp/gpu/question.jsonl ] && export SPECRAY_SPEC_BENCH=${SPECRAY_SPEC_BENCH:-/tmp/gpu/question.jsonl}
# the device tool returns at most 8 files a run: everything also goes into one archive, rewritten at every
# progress line, so a run cut off by its time limit still brings back all that finished
pack() { tar -czf "$OUT.tgz" --exclude=./results.tgz -C "$OUT" . 2>/dev/null && mv "$OUT.tgz" "$OUT/results.tgz"; }
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/progress.txt"; pack; }
trap pack EXIT
# llama.cpp's libraries loaded before anything imports numpy.linalg (the import-order crash on this image)
spec() { python3 -c 'import sys, llama_cpp; llama_cpp.llama_backend_init(); from specray.cli.main import main; sys.exit(main())' "$@"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
log "model $M"

# 1. the import-order crash: numpy.linalg first, then a model load (rc 139 = segfault)
timeout 60 python3 -c "import numpy.linalg; from specray.native.model import Model; m = Model('$M'); print('loaded, gpu layers', m.n_gpu_layers)" \
  > "$OUT/import_order.txt" 2>&1; echo "rc=$?" >> "$OUT/import_order.txt"
log "import order: $(tail -2 "$OUT/import_order.txt" | tr '\n' ' ')"

if [ "${1:-}" = pricing ]; then
  for s in 1 4; do
    log "pricing s$s"
    spec bench --model "$M" --threads "$THREADS" --slots $s --per-category $(( s == 1 ? 3 : 4 )) --categories "$CATS" \
      --max-tokens "$MAX_TOKENS" --configs none ngram_mod,suffix,ngram_cache --verify-shape both --verify-buckets 4 \
      > "$OUT/pricing_s$s.txt" 2>&1
    log "pricing s$s: rc $?"
  done
  exit 0
fi

bench() {  # bench NAME SLOTS PER_CATEGORY [extra flags]
  local name=$1 slots=$2 per=$3; shift 3
  log "bench $name: slots $slots"
  spec bench --model "$M" --threads "$THREADS" --slots "$slots" --per-category "$per" --categories "$CATS" \
    --max-tokens "$MAX_TOKENS" --json "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  log "bench $name: rc $?"
}
CONFIGS=(none ngram_mod ngram_mod,suffix,ngram_cache)
# 2. one slot: plain vs the default chain vs ngram_mod, exact shapes vs shape-stable (bucketed) verifies
bench s1 1 3 --configs "${CONFIGS[@]}" --verify-shape both
# 3. the GPU tests (offload, import order, lossless speculation with both verify shapes)
log "gpu tests"
SPECRAY_TEST_MODEL=$M timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -s > "$OUT/gpu_tests.txt" 2>&1
log "gpu tests: $(tail -1 "$OUT/gpu_tests.txt")"

lls() {  # lls NAME NP [llama-server flags]: llama-server from the same sources, over HTTP
  local name=$1 np=$2; shift 2
  [ -x "${LLAMA_SERVER:-}" ] || { log "no llama-server (\$LLAMA_SERVER): $name skipped"; return; }
  "$LLAMA_SERVER" -m "$M" -ngl 99 --host 127.0.0.1 --port 8090 -np "$np" -c 4096 -t "$THREADS" "$@" \
    > "$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8090/health', timeout=1)" 2>/dev/null && break
    sleep 0.5
  done
  log "llama-server $name ($*)"
  spec bench --url http://127.0.0.1:8090 --no-in-process --streams 1 "$np" --categories "$CATS" --per-category 3 \
    --num-prompts 18 --max-tokens "$MAX_TOKENS" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  log "llama-server $name: rc $?"
  kill "$pid"; wait "$pid" 2>/dev/null
}
# 4. llama-server, plain and with its ngram-mod drafts
lls lls_none 4
lls lls_ngram_mod 4 --spec-type ngram-mod
[ "${1:-}" = quick ] && exit 0

# 5. several slots
bench s4 4 4 --configs "${CONFIGS[@]}" --verify-shape both
bench s8 8 8 --configs none ngram_mod,suffix,ngram_cache --verify-shape both
# 6. where the host time goes with the default chain (cProfile of the measured rounds)
bench s1_profile 1 2 --configs ngram_mod,suffix,ngram_cache --no-llama-baseline --profile "$OUT/s1_profile.prof.txt"
log "done"
