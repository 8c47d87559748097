#!/usr/bin/env bash
# Writes a clean copy of a commit (HEAD, or the branch/commit given) plus the carried build
# dependencies to .snap/ of this checkout, for device runs: the device copies the working
# tree, which may hold unfinished edits, and only the main checkout's (so a branch is
# snapshotted from here: `scripts/device_snapshot.sh some-branch`).
# Then: run with carry [".snap"] and a command starting `cd .snap && ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-HEAD}
commit=$(git rev-parse --short "$ref^{commit}")
# A worktree's .git is a file: the exclude list lives in the common git directory.
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.snap/' "$exclude" 2>/dev/null || echo '/.snap/' >> "$exclude"
rm -rf .snap && mkdir .snap
git archive "$commit" | tar -x -C .snap
# The copy has no .git: scripts read the commit from here.
echo "$commit" > .snap/COMMIT
[ -d .deps ] && cp -r .deps .snap/.deps
echo "snapshot of $commit ($ref) in .snap ($(du -sh .snap | cut -f1))"
