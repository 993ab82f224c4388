#!/usr/bin/env bash
# On the GPU machine, in the checkout: takes one part of scripts/gpu-kit.sh's kit (a folder pN) into the kit
# folder ($SPECRAY_KIT, default /tmp/specray-kit, which outlives a device call while the machine stays warm);
# once a group's parts are all there, checks their hash and unpacks them. When the core group is in, unzips
# its wheels (no index, no build), lays out llama_cpp over the prebuilt libraries, exposes the checkout as the
# `specray` namespace, builds the engine's compiled cores (small C files) and writes $SPECRAY_KIT/env.sh: a few
# seconds.
#
#   bash scripts/gpu-kit-setup.sh .gpu/p1     # every part, in any order; then:
#   source /tmp/specray-kit/env.sh && OUT=/some/dir bash scripts/gpu-measure.sh
#
# env.sh sets PY, PYTHONPATH (the kit's packages first), LD_LIBRARY_PATH (CUDA's runtime and cuBLAS where the
# machine has them),
# LLAMA_SERVER and SPECRAY_GPU_MODELS. Exit status 3: parts are still missing (which, on stderr).
set -euo pipefail
part=${1:?usage: gpu-kit-setup.sh PART_FOLDER}
REPO=$PWD
KIT=${SPECRAY_KIT:-/tmp/specray-kit}
PY=${PY:-python3}
t0=$(date +%s)
[[ -f "$part/KIT" ]] || { echo "gpu-kit-setup.sh: $part has no KIT file: not a part of scripts/gpu-kit.sh's kit" >&2; exit 2; }
read -r group pieces sum < "$part/KIT"
mkdir -p "$KIT/parts/$group"
cp "$part"/"$group".tar.xz.* "$KIT/parts/$group/"
have=$(ls "$KIT/parts/$group" | wc -l)
if (( have < pieces )); then
    echo "gpu-kit-setup.sh: $group: $have of $pieces parts here; send the others" >&2
    exit 3
fi
cat "$KIT/parts/$group"/"$group".tar.xz.* > "$KIT/$group.tar.xz"
echo "$sum  $KIT/$group.tar.xz" | sha256sum -c --quiet - || { echo "gpu-kit-setup.sh: $group: hash mismatch, send its parts again" >&2; rm -rf "$KIT/parts/$group" "$KIT/$group.tar.xz"; exit 1; }
if command -v xz >/dev/null; then
    xz -dc "$KIT/$group.tar.xz" | tar -xf - -C "$KIT"
else
    "$PY" -c 'import lzma, sys, tarfile; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2])' "$KIT/$group.tar.xz" "$KIT"
fi
rm -rf "$KIT/parts/$group" "$KIT/$group.tar.xz"
echo "gpu-kit-setup.sh: $group unpacked in $(( $(date +%s) - t0 )) s" >&2

site=$KIT/site
case $group in
    core)
        mkdir -p "$site"
        # the wheels unzipped into one folder: an install with --target, without pip's checks of this Python
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$site" \
            $(ls "$KIT"/core/whl/*.whl 2>/dev/null)
        # llama_cpp loads its libraries from llama_cpp/lib: the kit's build, all from that one folder
        rm -rf "$site/llama_cpp" && cp -r "$KIT/core/llama_cpp" "$site/llama_cpp"
        mkdir -p "$site/llama_cpp/lib" && cp -P "$KIT"/core/lib/* "$site/llama_cpp/lib/"
        # llama-server beside those libraries: its RUNPATH is $ORIGIN, and it runs on the very same ones
        [[ -x "$KIT/core/bin/llama-server" ]] && cp "$KIT/core/bin/llama-server" "$site/llama_cpp/lib/"
        ;;
esac
[[ -f "$KIT/core/BUILD" ]] || { echo "gpu-kit-setup.sh: the core part is still missing" >&2; exit 3; }

# the checkout as the `specray` namespace (pyproject's package-dir mapping, without installing), made again on
# every call: a later call's checkout may be elsewhere
rm -rf "$KIT/pkg" && mkdir -p "$KIT/pkg/specray" && touch "$KIT/pkg/specray/__init__.py"
"$PY" - "$REPO" "$KIT/pkg/specray" <<'PY'
import os, re, sys
repo, dest = sys.argv[1], sys.argv[2]
text = open(os.path.join(repo, "pyproject.toml")).read()
block = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
for pkg, d in re.findall(r'^"?([\w.]+)"?\s*=\s*"([^"]+)"', block, re.M):
    parts = pkg.split(".")
    if parts[0] == "specray" and len(parts) == 2:
        os.symlink(os.path.join(repo, d), os.path.join(dest, parts[1]))
PY

# the engine's compiled cores (setup.py: every engine/**/_*_core.c) for this Python, beside their sources in the
# checkout, as pip install would build them; where this machine cannot (no C compiler or no Python headers), the
# speculators run their pure-Python references and the bench's JSON says so (meta.compiled_cores)
"$PY" - "$REPO" <<'PY' || echo "gpu-kit-setup.sh: compiled cores not built; the pure-Python references run" >&2
import os, pathlib, subprocess, sys, sysconfig
repo = pathlib.Path(sys.argv[1])
inc, ext = sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX")
for src in sorted((repo / "engine").rglob("_*_core.c")):
    lib = str(src.with_suffix("")) + ext
    # built aside, then renamed over: a process that loaded the old one keeps its own copy
    try:
        subprocess.run([(sysconfig.get_config_var("CC") or "cc").split()[0], "-O2", "-ffp-contract=off", "-shared",
                        "-fPIC", f"-I{inc}", "-o", lib + ".tmp", str(src)], check=True)
        os.replace(lib + ".tmp", lib)
    finally:
        pathlib.Path(lib + ".tmp").unlink(missing_ok=True)
    print(f"gpu-kit-setup.sh: built {src.relative_to(repo)}", file=sys.stderr)
PY

# CUDA's runtime and cuBLAS: the libraries were linked against libcudart.so.13 and libcublas.so.13; the machine's
# own (its CUDA toolkit, or the nvidia wheels torch brings) go on the loader's path
cuda_dirs=""
candidates="/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $("$PY" -c 'import glob, site; print(" ".join(d for p in site.getsitepackages() for d in glob.glob(p + "/nvidia/cu*/lib") + glob.glob(p + "/nvidia/*/lib")))' 2>/dev/null)"
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
    for d in $candidates; do
        [[ -e "$d/$lib" ]] || continue
        [[ ":$cuda_dirs:" == *":$d:"* ]] || cuda_dirs=${cuda_dirs:+$cuda_dirs:}$d
        break
    done
done
models=$(ls -d "$KIT"/*/models 2>/dev/null | tr '\n' ' ')
cat > "$KIT/env.sh" <<EOS
export PY=$PY PYTHONUNBUFFERED=1
export PYTHONPATH=$KIT/pkg:$site$( [[ -d "$KIT/ray/site" ]] && echo ":$KIT/ray/site")\${PYTHONPATH:+:\$PYTHONPATH}
export LD_LIBRARY_PATH=${cuda_dirs:+$cuda_dirs:}\${LD_LIBRARY_PATH:-}
export LLAMA_SERVER=$( [[ -x "$site/llama_cpp/lib/llama-server" ]] && echo "$site/llama_cpp/lib/llama-server")
export SPECRAY_GPU_MODELS=$KIT/models
EOS
# one models folder for every group's models
mkdir -p "$KIT/models" && for m in $models; do [[ "$m" == "$KIT/models" ]] || ln -sf "$m"/*.gguf "$KIT/models/"; done
# shellcheck disable=SC1091
source "$KIT/env.sh"
"$PY" -c 'import llama_cpp; llama_cpp.llama_backend_init(); print("llama_cpp", llama_cpp.__version__, "gpu offload:", llama_cpp.llama_supports_gpu_offload())'
echo "gpu-kit-setup.sh: ready in $(( $(date +%s) - t0 )) s (CUDA libraries from: ${cuda_dirs:-none found}); source $KIT/env.sh" >&2
