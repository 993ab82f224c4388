# Sourced (not run) by `setup.sh --wheelhouse DIR` with $wheelhouse = DIR and $extra = the extras asked for:
# checks DIR (written by scripts/wheelhouse.sh), makes every pip call offline from it (PIP_NO_INDEX,
# PIP_FIND_LINKS; build-llama-cpp.sh takes the llama-cpp-python sdist from $SPECRAY_WHEELHOUSE), and narrows
# --dev's "[dev,train]" to "[dev]" where DIR was written without --train (torch). Defines wheelhouse_preflight.
_wh_fail() { echo "setup.sh: --wheelhouse $wheelhouse: $*" >&2; exit 2; }
_wh=$(cd "$wheelhouse" 2>/dev/null && pwd) || _wh_fail "no such directory"
[[ -f "$_wh/MANIFEST" ]] || _wh_fail "no MANIFEST there; write the wheelhouse with: bash scripts/wheelhouse.sh DIR [--dev]"
_wh_extras=$(sed -n 's/^extras: //p' "$_wh/MANIFEST")
if [[ "$extra" == *dev* && " $_wh_extras " != *" dev "* ]]; then
    _wh_fail "--dev needs the dev extra (pytest, gguf, ...), which it lacks: bash scripts/wheelhouse.sh DIR --dev"
fi
if [[ "$extra" == *train* && " $_wh_extras " != *" train "* ]]; then
    echo "setup.sh: the wheelhouse has no train extra (torch): installing [dev] only, so \`specray train-head\`" \
         "will not run (bash scripts/wheelhouse.sh DIR --dev --train adds it)" >&2
    extra="[dev]"
fi
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$_wh" SPECRAY_WHEELHOUSE="$_wh"

wheelhouse_preflight() {  # PYTHON: fail before building anything if DIR cannot satisfy the install, naming why
    local py=$1 want have out
    want=$(sed -n 's/^python-version: //p' "$_wh/MANIFEST")
    have=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [[ "$want" == "$have" ]] || _wh_fail "its wheels are for Python $want, this venv's is $have" \
        "(bash scripts/wheelhouse.sh DIR --python-version $have, or PYTHON=python$want)"
    # the project's requirements resolved from DIR alone; llama-cpp-python from the metadata-only stand-in
    if ! out=$("$py" -m pip install --dry-run --quiet --ignore-installed --find-links "$_wh" \
            --find-links "$_wh/.resolve" ".$extra" 2>&1); then
        echo "$out" | grep -E "ERROR|No matching|Could not find" >&2 || echo "$out" | tail -5 >&2
        _wh_fail "it cannot satisfy the install above (a wheel missing for this Python or platform)"
    fi
    echo "setup.sh: installing offline from $_wh (Python $have, extras ${extra:-none})" >&2
}
