#!/usr/bin/env bash
# Benchmarks an OpenAI-compatible server (specray serve, llama-server) with an
# outside client, guidellm 0.8.1, for measurement only: guidellm is NOT a
# specray dependency and lives in its own venv outside the repository.
#
# Usage: bash scripts/guidellm-bench.sh URL PROMPTS.jsonl OUT.json [STREAMS]
#   URL            the server's base URL, without /v1 (e.g. http://127.0.0.1:8000)
#   PROMPTS.jsonl  {"prompt": ..., "output_tokens_count": N} lines, e.g. from
#                  python3 scripts/spec-bench-prompts.py prompts.jsonl 20 128
#   OUT.json       guidellm's JSON report
#   STREAMS        concurrent streams, one number or a comma list (default 1)
# Every prompt is sent once per stream count (max_requests = the prompt count),
# as a streamed chat completion with max_completion_tokens = output_tokens_count
# and ignore_eos, so every server generates the same number of tokens.
#
# Environment (SPECRAY_-prefixed: guidellm warns about GUIDELLM_* names it
# does not know):
#   SPECRAY_GUIDELLM_VENV      guidellm's venv (default: tools/guidellm-venv
#                              next to the repository); created on first use
#                              with guidellm==0.8.1 and gguf (it pulls torch
#                              and transformers: several GB)
#   SPECRAY_GUIDELLM_TOKENIZER a Hugging Face tokenizer directory (default:
#                              ~/.cache/specray/hf-tokenizer/<GGUF name>),
#                              written on first use from the model's GGUF
#                              (transformers' gguf_file loader)
#   MODEL                      specray model alias or .gguf path whose
#                              tokenizer guidellm counts tokens with (default:
#                              smollm2-135m, resolved by the repository's .venv
#                              as `specray serve` resolves it)
set -euo pipefail

if [[ $# -lt 3 || $# -gt 4 ]]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
URL=${1%/}
PROMPTS=$2
OUT=$3
STREAMS=${4:-1}
HERE=$(cd "$(dirname "$0")/.." && pwd)
VENV=${SPECRAY_GUIDELLM_VENV:-$(dirname "$HERE")/tools/guidellm-venv}
MODEL=${MODEL:-smollm2-135m}

[[ -f "$PROMPTS" ]] || { echo "guidellm-bench: no such prompts file: $PROMPTS" >&2; exit 2; }
[[ "$STREAMS" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || {
    echo "guidellm-bench: STREAMS must be a positive number or a comma list, got '$STREAMS'" >&2; exit 2; }

if [[ ! -x "$VENV/bin/guidellm" ]]; then
    echo "guidellm-bench: installing guidellm 0.8.1 into $VENV (one-off; pulls torch, several GB)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "guidellm==0.8.1" gguf >&2
fi

if [[ -z "${SPECRAY_GUIDELLM_TOKENIZER:-}" ]]; then
    GGUF=$("$HERE/.venv/bin/python" -c \
        "import sys; from specray.native.models import resolve_model; print(resolve_model(sys.argv[1]))" "$MODEL")
    SPECRAY_GUIDELLM_TOKENIZER="$HOME/.cache/specray/hf-tokenizer/$(basename "$GGUF" .gguf)"
    if [[ ! -f "$SPECRAY_GUIDELLM_TOKENIZER/tokenizer.json" ]]; then
        echo "guidellm-bench: writing $GGUF's tokenizer to $SPECRAY_GUIDELLM_TOKENIZER" >&2
        "$VENV/bin/python" - "$GGUF" "$SPECRAY_GUIDELLM_TOKENIZER" <<'EOF' >&2
import os, sys
from transformers import AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
EOF
    fi
fi

N=$(grep -c . "$PROMPTS")
# guidellm's kind=... strings split on commas; a list is spelled streams[0]=1,streams[1]=4
IFS=, read -ra _streams <<< "$STREAMS"
STREAM_ARGS=""
for i in "${!_streams[@]}"; do STREAM_ARGS+=",streams[$i]=${_streams[$i]}"; done
echo "guidellm-bench: $N prompts from $PROMPTS against $URL, streams $STREAMS" >&2
# max_requests: each stream count runs through the prompts once; the console
# table goes to stderr so stdout stays quiet for scripts
"$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL" \
    --profile "kind=concurrent$STREAM_ARGS" \
    --constraint "kind=max_requests,count=$N" \
    --data "kind=json_file,path=$PROMPTS" \
    --tokenizer "kind=hf_auto,model=$SPECRAY_GUIDELLM_TOKENIZER" \
    --output "kind=json,path=$OUT" \
    --output kind=console \
    --disable-console-interactive >&2
# one line per stream count on stdout, from the JSON: what a comparison needs
"$VENV/bin/python" - "$OUT" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    m = b["metrics"]
    ok = lambda k: m[k]["successful"]
    ttft, itl = ok("time_to_first_token_ms"), ok("inter_token_latency_ms")
    print(f"streams {b['config']['strategy'].get('streams')}: {ok('request_latency')['count']} requests ok, "
          f"{ok('output_token_count')['total_sum'] / b['duration']:.1f} output tok/s (all output tokens / "
          f"{b['duration']:.1f} s), TTFT median {ttft['median']:.1f} ms p95 {ttft['percentiles']['p95']:.1f} ms, "
          f"ITL median {itl['median']:.1f} ms")
PY
echo "guidellm-bench: wrote $OUT" >&2
