#!/usr/bin/env bash
# The measurements a lent GPU machine is for, in order of value, each writing into $OUT as it goes (a run
# cut off by its time limit still returns what finished). Run on the GPU machine after the kit's set-up
# (docs/gpus.md: scripts/gpu-kit.sh here, scripts/gpu-kit-setup.sh there), in the checkout:
#   source /tmp/specray-kit/env.sh && OUT=/some/dir bash scripts/gpu-measure.sh [quick]
# `quick`: 1 slot only (the shape-stable verdict and the round breakdown), then llama-server.
# `pricing`: only the default chain against plain decoding at 1 and 4 slots, exact shapes and one padded shape
# (--verify-buckets 4: every round 4 rows a sequence, drafts of at most 3), one text file each.
# `waiting`: only the measurements still outstanding, in order of value: `imports` (the import-order crash: which
# library files each order maps, the recipe as it is against one folder), `synth` (the synthetic 1.5B target's
# cost curve and round overhead; writes ~1.6 GB to $SYNTH_DIR, default /tmp, in ~1-2 min; SYNTH_PARAMS and
# SYNTH_TYPE change its size and weight type), `hidden` (MTP and
# EAGLE-3 with target and companion actors on one GPU, the round's transfer share per transport; needs Ray:
# scripts/gpu-kit.sh --ray), `gemma` (Gemma 3 270M at 1, 4 and 8 slots and llama-server on it; scripts/gpu-kit.sh --gemma),
# `hop` (distributed over HTTP: the target actor reached by an actor call vs a Ray Compiled Graph, and the
# in-process engine; then the companion's draft calls the same two ways; needs Ray), `sampling` (greedy top tokens picked inside the decode graph against the host's
# argmax over the logits rows it copies: scripts/measure_backend_sampling.py). Each of those also runs alone
# (`bash scripts/gpu-measure.sh synth`); the full run ends with them.
# Needs: $SPECRAY_GPU_MODELS (the models), $LLAMA_SERVER (built from the same llama.cpp sources); the kit
# (scripts/gpu-kit.sh, scripts/gpu-kit-setup.sh) sets both in its env.sh.
# The whole run keeps to MEASURE_BUDGET_S seconds (default 480, so that it fits one 10-minute device call with
# the kit's set-up): every step gets what is left, and a step with too little left is skipped, saying so.
# Knobs for a short run (the CPU dry run in the suite: tests/integration/test_gpu_kit.py): MAX_TOKENS, CATS,
# PER_MAX (prompts per category, at most), THREADS, SYNTH_PARAMS, SAMPLING_REPS, SKIP (steps whose names start
# so: imports s1 gpu_tests lls_none lls_ngram_mod s4 s8 s1_profile sampling synth hidden hop gemma).
# Installed with `setup.sh --wheelhouse` instead of the recipe: PY=.venv/bin/python (no env.sh needed but for
# the models and llama-server).
set -uo pipefail
case "${1:-}" in
  ""|quick|pricing|waiting|imports|synth|hidden|gemma|hop|sampling) ;;
  *) echo "gpu-measure.sh: unknown step '$1' (quick, pricing, waiting, imports, synth, hidden, gemma, hop, sampling)" >&2; exit 2 ;;
esac
OUT=${OUT:?set OUT to the folder for the results}
M=${MODEL:-$(ls "$SPECRAY_GPU_MODELS"/*.gguf | grep -i smol | head -1)}
CATS=${CATS:-coding,math,qa,rag,summarization,translation}
THREADS=${THREADS:-4}
MAX_TOKENS=${MAX_TOKENS:-128}  # a dry run elsewhere: MAX_TOKENS=8
PER_MAX=${PER_MAX:-99}
END=$(( $(date +%s) + ${MEASURE_BUDGET_S:-480} ))
mkdir -p "$OUT"
# the prompts: Spec-Bench as the checkout ships it (bench/data/spec_bench.jsonl), unless SPECRAY_SPEC_BENCH is set
# the device tool returns at most 8 files a run: everything also goes into one archive, rewritten at every
# progress line, so a run cut off by its time limit still brings back all that finished
pack() { tar -czf "$OUT.tgz" --exclude=./results.tgz -C "$OUT" . 2>/dev/null && mv "$OUT.tgz" "$OUT/results.tgz"; }
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/progress.txt"; pack; }
trap pack EXIT
PY=${PY:-python3}
# llama.cpp's libraries loaded before anything imports numpy.linalg (the import-order crash on this image)
SPEC=("$PY" -c 'import sys, llama_cpp; llama_cpp.llama_backend_init(); from specray.cli.main import main; sys.exit(main())')
spec() { "${SPEC[@]}" "$@"; }
# the same for every process Ray starts (its actors import numpy first): a sitecustomize on PYTHONPATH
PRELOAD=$(mktemp -d) && echo 'import llama_cpp; llama_cpp.llama_backend_init()' > "$PRELOAD/sitecustomize.py"
LIBDIR=$("$PY" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("llama_cpp").submodule_search_locations[0], "lib"))')
has_ray() { "$PY" -c 'import ray' 2>/dev/null; }
per() { echo $(( $1 < PER_MAX ? $1 : PER_MAX )); }  # prompts per category, capped by PER_MAX
# seconds left of the run's budget; `budget NAME NEED` says whether step NAME runs (not in SKIP, NEED seconds left)
left() { echo $(( END - $(date +%s) )); }
limit() { local l; l=$(left); echo $(( l > 1 ? l : 1 )); }  # a command's timeout: what is left, never 0 (no limit)
budget() {
  local k
  for k in ${SKIP:-}; do [[ "$1" == "$k"* ]] && { log "$1: skipped (SKIP=$k)"; return 1; }; done
  (( $(left) >= $2 )) || { log "$1: skipped, $(left) s left of the run's budget (MEASURE_BUDGET_S)"; return 1; }
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
log "model $M"

# native/shared_libs.py refuses a process whose llama.cpp libraries come from two folders (the recipe's install:
# libllama from site-packages, ggml through its RUNPATH from the build tree); measure such an install anyway
if ! "$PY" -c 'import specray.native.lib' > "$OUT/shared_libs.txt" 2>&1; then
  export SPECRAY_ALLOW_MIXED_GGML=1
  log "install maps llama.cpp's libraries from two places ($(grep -o 'come from two folders[^.]*' "$OUT/shared_libs.txt" | head -1)): SPECRAY_ALLOW_MIXED_GGML=1 for the rest"
fi

imports_step() {  # the import-order crash: which order, which folders, and where it dies (rc 139 = segfault)
  local load="from specray.native.model import Model; from specray.native import lib; m = Model('$M'); print('loaded, gpu layers', m.n_gpu_layers); print(lib.LIBRARIES)"
  for so in "$LIBDIR"/libllama.so "$LIBDIR"/libggml.so "$LIBDIR"/libggml-cuda.so; do
    echo "== $so -> $(readlink -f "$so")"; readelf -d "$so" 2>&1 | grep -E 'NEEDED|RUNPATH|RPATH'
  done > "$OUT/import_runpath.txt" 2>&1
  local name env first
  for name in numpy_first llama_first numpy_first_one_folder; do
    env=(SPECRAY_ALLOW_MIXED_GGML=1); first="import numpy.linalg"
    [ $name = llama_first ] && first="import llama_cpp; llama_cpp.llama_backend_init(); import numpy.linalg"
    # LD_LIBRARY_PATH wins over a RUNPATH: every library from llama_cpp/lib, the one-folder install
    [ $name = numpy_first_one_folder ] && env+=(LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    env "${env[@]}" timeout 90 "$PY" -X faulthandler -c "$first; $load" > "$OUT/import_$name.txt" 2>&1
    echo "rc=$?" >> "$OUT/import_$name.txt"
    log "import order, $name: $(tail -1 "$OUT/import_$name.txt")"
  done
  if grep -q 'rc=139' "$OUT/import_numpy_first.txt" && command -v gdb >/dev/null; then
    SPECRAY_ALLOW_MIXED_GGML=1 timeout 120 gdb -q -batch -ex run -ex bt -ex 'info sharedlibrary' --args \
      "$PY" -c "import numpy.linalg; $load" > "$OUT/import_gdb.txt" 2>&1
    log "import order: gdb backtrace in import_gdb.txt"
  fi
  "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_shared_libs.py > "$OUT/import_unit.txt" 2>&1
  log "import order: shared-library unit tests: $(tail -1 "$OUT/import_unit.txt")"
}

synth_step() {  # the synthetic 1.5B target: write it once, then its verify cost curve and a round's host overhead
  budget synth 90 || return
  local f=${SYNTH_DIR:-/tmp}/synth-${SYNTH_PARAMS:-1.5B}-${SYNTH_TYPE:-q8_0}.gguf
  mkdir -p "$(dirname "$f")" && df -h "$(dirname "$f")" > "$OUT/synth_disk.txt" 2>&1
  if [ ! -f "$f" ]; then
    log "synth: writing $f (${SYNTH_PARAMS:-1.5B}, ${SYNTH_TYPE:-q8_0}; 1.5B: ~1.6 GB q8_0, 3 GB f16)"
    timeout "$(limit)" "${SPEC[@]}" synth-model --params "${SYNTH_PARAMS:-1.5B}" --type "${SYNTH_TYPE:-q8_0}" --vocab-from "$M" --out "$f" > "$OUT/synth_write.txt" 2>&1
    log "synth: written, rc $?: $(tail -1 "$OUT/synth_write.txt")"
  fi
  timeout "$(limit)" "${SPEC[@]}" cost-curve --model "$f" --max-k 16 --threads "$THREADS" --json "$OUT/synth_curve.json" > "$OUT/synth_curve.txt" 2>&1
  log "synth: cost curve (SYNTHETIC) rc $?: $(tail -16 "$OUT/synth_curve.txt" | awk '{printf "%s:%s ", $1, $3}')"
  for s in 1 4; do  # host time per round on a realistic step (acceptance on random weights means nothing)
    budget "synth" 30 || return
    log "synth: bench (SYNTHETIC) slots $s"
    timeout "$(limit)" "${SPEC[@]}" bench --model "$f" --threads "$THREADS" --slots $s --per-category 1 --categories "$CATS" --max-tokens "$(( MAX_TOKENS < 64 ? MAX_TOKENS : 64 ))" \
      --configs none ngram_mod,suffix,ngram_cache --no-llama-baseline --json "$OUT/synth_bench_s$s.json" \
      > "$OUT/synth_bench_s$s.txt" 2> "$OUT/synth_bench_s$s.err"
    log "synth: bench slots $s: rc $?"
  done
}

hidden_step() {  # MTP and EAGLE-3 (synthetic) with target and companion actors sharing one GPU, per transport
  budget hidden 60 || return
  # CUDA IPC between two processes with the real CUDA runtime (skips, saying why, where it cannot run)
  PYTHONPATH="$PRELOAD${PYTHONPATH:+:$PYTHONPATH}" timeout "$(limit)" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/unit/test_hidden_transport.py > "$OUT/hidden_tests.txt" 2>&1
  log "hidden rows: transport tests: $(tail -1 "$OUT/hidden_tests.txt")"
  has_ray || { log "hidden rows: skipped, no Ray on this machine (scripts/gpu-kit.sh --ray)"; return; }
  budget hidden 120 || return
  # Ray's actors import numpy before llama.cpp: preload llama_cpp in every process, as spec() does here
  PYTHONPATH="$PRELOAD${PYTHONPATH:+:$PYTHONPATH}" timeout "$(limit)" "$PY" -m specray.bench.hidden --target "$M" \
    --gpus 0.5 --kinds mtp eagle3 --seqs 1 8 --transports object_store inline cuda_ipc --max-tokens 64 \
    --json "$OUT/hidden.json" > "$OUT/hidden.txt" 2> "$OUT/hidden.err"
  log "hidden rows: rc $?: $(grep -c -E '^(mtp|eagle3) ' "$OUT/hidden.txt") rows"
}

hop_step() {  # distributed over HTTP, plain decoding: actor call vs compiled graph per round, and in-process
  has_ray || { log "hop: skipped, no Ray on this machine (scripts/gpu-kit.sh --ray)"; return; }
  budget hop 120 || return
  log "hop: actor vs compiled target hop"
  PYTHONPATH="$PRELOAD${PYTHONPATH:+:$PYTHONPATH}" timeout "$(limit)" "$PY" -c \
    'import sys, llama_cpp; llama_cpp.llama_backend_init(); from specray.cli.main import main; sys.exit(main())' bench --http \
    --serve-modes distributed --target-hops actor,compiled --model "$M" --threads "$THREADS" --spec none \
    --streams 1 4 8 --num-prompts 8 --max-tokens "$MAX_TOKENS" --json "$OUT/hop.json" > "$OUT/hop.txt" 2> "$OUT/hop.err"
  log "hop: rc $?"
  # the companion's round calls: a draft model (the target itself, every round drafting: --policy first)
  budget hop 120 || return
  log "hop: actor vs compiled companion hop"
  PYTHONPATH="$PRELOAD${PYTHONPATH:+:$PYTHONPATH}" timeout "$(limit)" "$PY" -c \
    'import sys, llama_cpp; llama_cpp.llama_backend_init(); from specray.cli.main import main; sys.exit(main())' bench --http \
    --serve-modes distributed --target-hops compiled --companion-hops actor,compiled --model "$M" --threads "$THREADS" \
    --spec draft --draft-model "$M" --policy first --n-max 3 --streams 1 4 --num-prompts 8 --max-tokens "$MAX_TOKENS" \
    --json "$OUT/hop_companion.json" > "$OUT/hop_companion.txt" 2> "$OUT/hop_companion.err"
  log "hop (companion): rc $?"
}

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

bench() {  # bench NAME SLOTS PER_CATEGORY [extra flags]; the model is $BM (default $M)
  local name=$1 slots=$2 per; per=$(per "$3"); shift 3
  budget "$name" 30 || return
  log "bench $name: slots $slots, $(basename "${BM:-$M}")"
  timeout "$(limit)" "${SPEC[@]}" bench --model "${BM:-$M}" --threads "$THREADS" --slots "$slots" --per-category "$per" --categories "$CATS" \
    --max-tokens "$MAX_TOKENS" --json "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  log "bench $name: rc $?"
}
lls() {  # lls NAME NP [llama-server flags]: llama-server from the same sources, over HTTP; the model is $BM
  local name=$1 np=$2; shift 2
  [ -x "${LLAMA_SERVER:-}" ] || { log "no llama-server (\$LLAMA_SERVER): $name skipped"; return; }
  budget "$name" 40 || return
  "$LLAMA_SERVER" -m "${BM:-$M}" -ngl 99 --host 127.0.0.1 --port 8090 -np "$np" -c 4096 -t "$THREADS" "$@" \
    > "$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8090/health', timeout=1)" 2>/dev/null && break
    sleep 0.5
  done
  log "llama-server $name ($*)"
  timeout "$(limit)" "${SPEC[@]}" bench --url http://127.0.0.1:8090 --no-in-process --streams 1 "$np" --categories "$CATS" --per-category "$(per 3)" \
    --num-prompts 18 --max-tokens "$MAX_TOKENS" --json "$OUT/$name.json" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  log "llama-server $name: rc $?"
  kill "$pid"; wait "$pid" 2>/dev/null
}
sampling_step() {  # greedy top tokens picked inside the decode graph vs the host's argmax over copied logits rows
  budget sampling 40 || return
  log "backend sampling"
  "$PY" -c 'import llama_cpp; llama_cpp.llama_backend_init(); import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' \
    scripts/measure_backend_sampling.py --model "$M" --slots 1 4 8 --rows 1 4 --reps "${SAMPLING_REPS:-40}" --threads "$THREADS" \
    --json "$OUT/sampling.json" > "$OUT/sampling.txt" 2>&1
  log "backend sampling: rc $? $(tail -1 "$OUT/sampling.txt")"
}
CONFIGS=(none ngram_mod ngram_mod,suffix,ngram_cache)
gemma_step() {  # Gemma 3 270M at 1, 4 and 8 slots, and llama-server on it with and without ngram-mod drafts
  local G
  G=$(ls "$SPECRAY_GPU_MODELS"/*.gguf 2>/dev/null | grep -i gemma | head -1)
  [ -n "$G" ] || { log "gemma: skipped, no Gemma GGUF in \$SPECRAY_GPU_MODELS (scripts/gpu-kit.sh --gemma)"; return; }
  BM=$G bench gemma_s1 1 3 --configs "${CONFIGS[@]}"
  BM=$G bench gemma_s4 4 4 --configs "${CONFIGS[@]}"
  BM=$G bench gemma_s8 8 8 --configs "${CONFIGS[@]}"
  BM=$G lls gemma_lls_none 4
  BM=$G lls gemma_lls_ngram_mod 4 --spec-type ngram-mod
}

case "${1:-}" in
  imports|synth|hidden|gemma|hop|sampling) "${1}_step"; log "done"; exit 0 ;;
  waiting) imports_step; sampling_step; synth_step; hidden_step; hop_step; gemma_step; log "done"; exit 0 ;;
esac

# 1. the import-order crash, the recipe's install as it is against one folder
budget imports 60 && imports_step

# 2. one slot: plain vs the default chain vs ngram_mod, exact shapes vs shape-stable (bucketed) verifies
bench s1 1 3 --configs "${CONFIGS[@]}" --verify-shape both
# 3. the GPU tests (offload, import order, lossless speculation with both verify shapes)
budget gpu_tests 30 && log "gpu tests" && SPECRAY_TEST_MODEL=$M timeout "$(limit)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu -s > "$OUT/gpu_tests.txt" 2>&1
[ -f "$OUT/gpu_tests.txt" ] && log "gpu tests: $(tail -1 "$OUT/gpu_tests.txt")"

# 4. llama-server, plain and with its ngram-mod drafts
lls lls_none 4
lls lls_ngram_mod 4 --spec-type ngram-mod
[ "${1:-}" = quick ] && exit 0

# 5. several slots
bench s4 4 4 --configs "${CONFIGS[@]}" --verify-shape both
bench s8 8 8 --configs "${CONFIGS[@]}" --verify-shape both
# 5b. overlapped rounds (engine.overlap): the last round's text, events, speculator set-ups and the policy's learning
#     from its verdicts while the GPU decodes
bench s4_overlap 4 4 --configs none none@overlap ngram_mod,suffix,ngram_cache ngram_mod,suffix,ngram_cache@overlap \
  --no-llama-baseline
# 6. where the host time goes with the default chain (cProfile of the measured rounds)
bench s1_profile 1 2 --configs ngram_mod,suffix,ngram_cache --no-llama-baseline --profile "$OUT/s1_profile.prof.txt"
# 7. the measurements still outstanding: the synthetic 1.5B target, hidden rows on the GPU (Ray), Gemma
sampling_step
synth_step
hidden_step
hop_step
gemma_step
log "done"
