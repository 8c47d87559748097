#!/usr/bin/env bash
# Writes a clean copy of HEAD (plus the carried build dependencies) to .snap/, for device
# runs: the device copies the working tree, which may hold other people's unfinished edits.
# Then: run with carry [".snap"] and a command starting `cd .snap && ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
# A worktree's .git is a file: the exclude list lives in the common git directory.
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.snap/' "$exclude" 2>/dev/null || echo '/.snap/' >> "$exclude"
rm -rf .snap && mkdir .snap
git archive HEAD | tar -x -C .snap
# The copy has no .git: scripts read the commit from here.
git rev-parse --short HEAD > .snap/COMMIT
[ -d .deps ] && cp -r .deps .snap/.deps
echo "snapshot of $(git rev-parse --short HEAD) in .snap ($(du -sh .snap | cut -f1))"
