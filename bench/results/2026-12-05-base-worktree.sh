# Sourced by the before/after scripts of the compiled look-ups (2026-12-05-compiled-lookups-*.sh): BASE (a commit)
# checked out in a worktree of its own, its compiled cores built there, and $PKG a folder whose `specray` package
# is that worktree's sources (PYTHONPATH="$PKG" runs BASE with this checkout's venv). Both go at exit. Needs ROOT
# (this checkout) and BASE set.
WT=$(mktemp -d)/base
git worktree add --detach "$WT" "$BASE" >/dev/null
(cd "$WT" && "$ROOT/.venv/bin/python" setup.py -q build_ext --inplace >/dev/null 2>&1)
PKG=$(mktemp -d)
mkdir "$PKG/specray"
for d in engine native deployments cluster bench cli train; do ln -s "$WT/$d" "$PKG/specray/$d"; done
trap 'git worktree remove --force "$WT"; rm -rf "$PKG"' EXIT
