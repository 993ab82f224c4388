#!/usr/bin/env bash
# specray serve against llama-server, each ALONE on the machine: for every pass
# a fresh `specray serve` is started, benchmarked with `specray bench --url`
# and stopped, then a fresh llama-server (built by build-llama-server.sh from
# the same llama.cpp) the same way; the order alternates from pass to pass.
# Then a table of specray's tok/s over llama-server's, per pass and stream
# count (bench/alone_report.py). For measurement only, not part of the tests.
#
# Usage: bash scripts/bench-alone.sh OUT_DIR
#   OUT_DIR  gets each run's `specray bench` table and JSON, the servers' logs,
#            and summary.json
# Environment:
#   PASSES       passes, each running both servers (default 2)
#   MODEL        specray model alias or .gguf path (default smollm2-135m)
#   SPEC         specray serve --spec (default: its default chain; none: plain)
#   LLAMA_SPEC   llama-server --spec-type (default: none, plain decoding)
#   STREAMS      concurrent clients, space-separated (default "1 4")
#   NUM_PROMPTS  Spec-Bench prompts per row (default 8); MAX_TOKENS (default 128)
#   THREADS      both servers' CPU threads (default: nproc); SLOTS (default 4)
#                and N_CTX (default 4096) likewise (llama-server -np, -c)
#   LLAMA_SERVER the llama-server binary (default: build-llama-server.sh's,
#                built on first use, ~10 min on 2 cores)
#   PORT, LLAMA_PORT  (default 8000, 8090): refused if something listens there
# Why alone: on a small node each server's idle processes slow the other's
# decode (docs/serving.md, quiet local Ray); both up at once flatters whichever is
# measured beside the lighter neighbour.
set -euo pipefail

if [[ $# -ne 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
OUT=$1
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
SPECRAY=$HERE/.venv/bin/specray
PASSES=${PASSES:-2}
MODEL=${MODEL:-smollm2-135m}
SPEC=${SPEC:-}
LLAMA_SPEC=${LLAMA_SPEC:-none}
STREAMS=${STREAMS:-1 4}
NUM_PROMPTS=${NUM_PROMPTS:-8}
MAX_TOKENS=${MAX_TOKENS:-128}
THREADS=${THREADS:-$(nproc)}
SLOTS=${SLOTS:-4}
N_CTX=${N_CTX:-4096}
PORT=${PORT:-8000}
LLAMA_PORT=${LLAMA_PORT:-8090}

fail() { echo "bench-alone: $*" >&2; exit 2; }
[[ -x "$SPECRAY" ]] || fail "no $SPECRAY: run scripts/setup.sh first"
[[ "$PASSES" =~ ^[1-9][0-9]*$ ]] || fail "PASSES must be a positive number, got '$PASSES'"
[[ "$STREAMS" =~ ^[1-9][0-9]*( [1-9][0-9]*)*$ ]] || fail "STREAMS must be positive numbers, got '$STREAMS'"
for p in "$PORT" "$LLAMA_PORT"; do  # a connection that opens: something listens there
    ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || fail "something already listens on port $p (stop it first)"
done
GGUF=$("$PY" -c "import sys; from specray.native.models import resolve_model; print(resolve_model(sys.argv[1]))" \
    "$MODEL") || fail "MODEL '$MODEL' does not resolve to a GGUF"
LLAMA_SERVER=${LLAMA_SERVER:-$(bash "$HERE/scripts/build-llama-server.sh" "$PY")}
[[ -x "$LLAMA_SERVER" ]] || fail "LLAMA_SERVER '$LLAMA_SERVER' is not an executable"
mkdir -p "$OUT"

SERVE_ARGS=(--model "$MODEL" --port "$PORT" --threads "$THREADS" --slots "$SLOTS" --n-ctx "$N_CTX")
[[ -n "$SPEC" ]] && SERVE_ARGS+=(--spec "$SPEC")
LLAMA_ARGS=(-m "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" -np "$SLOTS" -c "$N_CTX" -t "$THREADS" -fa on)
[[ "$LLAMA_SPEC" != none ]] && LLAMA_ARGS+=(--spec-type "$LLAMA_SPEC")
# shellcheck disable=SC2206  # STREAMS is a list of words
BENCH=(--no-in-process --streams $STREAMS --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS")

pid=""
alive() {  # the server itself runs (a server that exited stays a zombie until waited for: kill -0 would say yes)
    local st
    st=$(ps -o stat= -p "$pid" 2>/dev/null) && [[ $st != Z* ]]
}
group_alive() {  # a process of the server's group that is not a zombie (the server itself is one until waited for)
    ps -e -o pgid=,stat= | awk -v g="$pid" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'
}
stop() {  # SIGINT (specray serve shuts its own Ray down), then SIGKILL to whatever of the group is left at 30 s
    [[ -z "$pid" ]] && return
    kill -INT -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do group_alive || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
}
trap stop EXIT

wait_health() {  # URL LOG: up to 5 minutes (specray serve: Ray's start, the model's load)
    for _ in $(seq 1 300); do
        curl -sf -m 2 -o /dev/null "$1/health" && return 0
        alive || { tail -20 "$2" >&2; fail "the server exited before answering $1/health"; }
        sleep 1
    done
    tail -20 "$2" >&2; fail "no answer from $1/health in 5 minutes"
}

run_one() {  # NAME PASS
    local name=$1 n=$2 url log
    log="$OUT/$name-$n.log"
    if [[ $name == specray ]]; then
        url=http://127.0.0.1:$PORT
        setsid "$SPECRAY" serve "${SERVE_ARGS[@]}" > "$log" 2>&1 &
    else
        url=http://127.0.0.1:$LLAMA_PORT
        setsid "$LLAMA_SERVER" "${LLAMA_ARGS[@]}" > "$log" 2>&1 &
    fi
    pid=$!
    wait_health "$url" "$log"
    echo "bench-alone: pass $n/$PASSES, $name at $url" >&2
    "$SPECRAY" bench --url "$url" "${BENCH[@]}" --json "$OUT/$name-$n.json" > "$OUT/$name-$n.txt"
    stop
}

for n in $(seq 1 "$PASSES"); do
    if (( n % 2 )); then run_one specray "$n"; run_one llama-server "$n"
    else run_one llama-server "$n"; run_one specray "$n"; fi
done
"$PY" -m specray.bench.alone_report "$OUT" --passes "$PASSES"
