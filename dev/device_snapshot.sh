#!/usr/bin/env bash
# Writes a clean copy of a commit (HEAD, or the branch/commit given) plus the carried build
# dependencies to .snap/ of this checkout, for device runs: the device copies the working
# tree, which may hold unfinished edits, and only the main checkout's (so a branch is
# snapshotted from here: `dev/device_snapshot.sh some-branch`).
# Then: run with carry [".snap"] and a command starting `cd .snap && ...`. For an A/B, a
# second snapshot: `dev/device_snapshot.sh main .snap_base`, carry [".snap", ".snap_base"],
# and `cd .snap && bash dev/ab.sh ../.snap_base`. Patches after the directory are applied to the
# copy (`dev/device_snapshot.sh main .snap_bwd dev/backward_split_tma.patch`): the experiments
# kept as dev/*.patch run as trees of their own without a branch.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-HEAD}
dir=${2:-.snap}  # another directory for a second snapshot (an A/B: dev/ab.sh)
commit=$(git rev-parse --short "$ref^{commit}")
# A worktree's .git is a file: the exclude list lives in the common git directory.
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
rm -rf "$dir" && mkdir "$dir"
git archive "$commit" | tar -x -C "$dir"
shift $(( $# < 2 ? $# : 2 ))
for patch in "$@"; do
  git apply --directory="$dir" "$patch"  # (from the top: the patch's paths under $dir)
  basename "$patch" >> "$dir/PATCHES"
done
# The copy has no .git: scripts read the commit from here.
echo "$commit${1:+ + $(tr '\n' ' ' < "$dir/PATCHES")}" > "$dir/COMMIT"
[ -d .deps ] && cp -r .deps "$dir/.deps"
echo "snapshot of $commit ($ref) in $dir ($(du -sh "$dir" | cut -f1))"
