#!/usr/bin/env bash
# Upstream FlashAttention's own test file for these functions (tests/test_flash_attn.py of the
# established package) run against flashattn, with only its imports changed. Scratch (dev/): the
# files are theirs and stay in upstream/, which git ignores.
#   dev/upstream_tests.sh prepare GIT_DIR   copy the test file and its helpers (bert_padding,
#                                           layers/rotary, ops/triton/rotary) out of a clone
#                                           of Dao-AILab/flash-attention into upstream/
#   dev/upstream_tests.sh sample [PER_TEST] [SEED]
#                                           on any machine (no GPU needed: the file's
#                                           compute-capability checks are answered as on
#                                           Hopper): collects the ids (about a minute) and
#                                           writes upstream/sample_ids.txt, PER_TEST drawn at
#                                           random (SEED) from each test function (default 20;
#                                           all of the smaller ones), for UPSTREAM_IDS
#   dev/upstream_tests.sh run [N] [SEED] [PYTEST_ARGS...]
#                                           on a GPU machine with flashattn installed: N cases
#                                           drawn at random (SEED) from the collected ones
#                                           (all when N = 0), run with pytest; writes
#                                           $OUT/upstream_failures.txt, one line per distinct
#                                           failure reason with its count. UPSTREAM_IDS=FILE:
#                                           the cases are drawn from FILE's ids (relative to
#                                           upstream/) instead of collecting them there: the
#                                           file has 508,777 cases, whose collection alone
#                                           takes a minute or more
set -uo pipefail
cd "$(dirname "$0")/.." || exit
dir=upstream
case ${1:-} in
  prepare)
    git_dir=${2:?usage: dev/upstream_tests.sh prepare GIT_DIR}
    mkdir -p "$dir"
    show() { git --git-dir="$git_dir" show "HEAD:$1"; }
    # The imports, and nothing else: flash_attn -> flashattn (our drop-in module path, also
    # for the internal _flash_attn_* functions some tests import inside their bodies), the
    # helpers from this folder; USE_TRITON_ROCM is their ROCm switch (off on CUDA). One test
    # imports their C++ extension itself (flash_attn_gpu) and cannot run.
    show tests/test_flash_attn.py | sed \
      -e 's/^from flash_attn import (/from flashattn import (/' \
      -e 's/^from flash_attn.bert_padding import/from bert_padding import/' \
      -e 's/^from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM$/from flashattn.flash_attn_interface import _get_block_size_n; USE_TRITON_ROCM = False/' \
      -e 's/^from flash_attn.layers.rotary import/from rotary import/' \
      -e 's/^\( *\)from flash_attn.flash_attn_interface import _flash_attn_/\1from flashattn.flash_attn_interface import _flash_attn_/' \
      >"$dir/test_flash_attn.py"
    show flash_attn/bert_padding.py >"$dir/bert_padding.py"
    show flash_attn/layers/rotary.py |
      sed 's/^from flash_attn.ops.triton.rotary import/from triton_rotary import/' >"$dir/rotary.py"
    show flash_attn/ops/triton/rotary.py >"$dir/triton_rotary.py"
    grep -n "flash_attn\b" "$dir"/*.py | grep -E "^[^:]+:[0-9]+:(from|import) " && {
      echo "upstream_tests: an import of flash_attn is left" >&2; exit 1; }
    git --git-dir="$git_dir" log -1 --format='prepared from %H (%cs)' | tee "$dir/SOURCE"
    ;;
  sample)
    [ -f "$dir/test_flash_attn.py" ] || { echo "upstream_tests: run prepare first" >&2; exit 2; }
    (cd "$dir" && python3 - "${2:-20}" "${3:-0}" >sample_ids.txt <<'PY'
import collections, contextlib, io, random, sys
import pytest, torch
torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)  # read at import: as on Hopper
class Ids:
    nodeids = []
    def pytest_collection_modifyitems(self, items):
        Ids.nodeids = [item.nodeid[item.nodeid.index("test_flash_attn.py"):] for item in items]  # relative to upstream/
with contextlib.redirect_stdout(io.StringIO()):
    pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "test_flash_attn.py"], plugins=[Ids()])
per, rng = int(sys.argv[1]), random.Random(int(sys.argv[2]))
by_test = collections.defaultdict(list)
for nodeid in Ids.nodeids:
    by_test[nodeid.split("[")[0]].append(nodeid)
sample = [i for test in sorted(by_test) for i in rng.sample(by_test[test], min(per, len(by_test[test])))]
print("\n".join(sorted(sample)))
print(f"{len(sample)} of {len(Ids.nodeids)} ids, {len(by_test)} test functions", file=sys.stderr)
PY
    ) && echo "upstream_tests: wrote $dir/sample_ids.txt"
    ;;
  run)
    n=${2:-400}; seed=${3:-0}; shift $(( $# < 3 ? $# : 3 ))
    out=${OUT:-gpu-results}; mkdir -p "$out"; out=$(cd "$out" && pwd)
    [ -f "$dir/test_flash_attn.py" ] || { echo "upstream_tests: run prepare first" >&2; exit 2; }
    ids=$out/upstream_ids.txt
    if [ -n "${UPSTREAM_IDS:-}" ]; then
      cp "$UPSTREAM_IDS" "$ids.all"
    else
      (cd "$dir" && python3 -m pytest --collect-only -q -p no:cacheprovider test_flash_attn.py) |
        grep '::' | sed "s|^$dir/||" >"$ids.all"  # ids relative to upstream/, where pytest runs
    fi
    python3 - "$ids.all" "$n" "$seed" >"$ids" <<'PY'
import random, sys
ids = open(sys.argv[1]).read().split()
n, seed = int(sys.argv[2]), int(sys.argv[3])
print("\n".join(ids if n == 0 or n >= len(ids) else sorted(random.Random(seed).sample(ids, n))))
PY
    echo "upstream_tests: $(wc -l <"$ids") of $(wc -l <"$ids.all") cases (seed $seed)"
    set -f  # the ids' brackets are not globs
    # shellcheck disable=SC2046  # one argument per id
    (cd "$dir" && python3 -m pytest -q -p no:cacheprovider -rfE "$@" $(cat "$ids")) \
      >"$out/upstream_pytest.log" 2>&1
    status=$?
    # One line per distinct reason: the exception line of each failure, counted.
    grep -E '^(FAILED|ERROR) ' "$out/upstream_pytest.log" | sed -E 's/^(FAILED|ERROR) [^ ]+ - //' |
      cut -c1-200 | sort | uniq -c | sort -rn >"$out/upstream_failures.txt"
    tail -1 "$out/upstream_pytest.log"
    head -20 "$out/upstream_failures.txt"
    exit $status
    ;;
  *) sed -n '2,23p' "$0"; exit 2 ;;
esac
