#!/usr/bin/env bash
# CI: build fastattn with gcc's AddressSanitizer and UndefinedBehaviorSanitizer
# in a virtual environment of its own, then run the test suite against that
# build.  Any sanitizer report aborts the test process, so it fails CI.
#
#   bash .ci/sanitize.sh            (from anywhere; uses a fresh temporary directory)
#
# The suite runs from a directory without the source tree, so that the
# sanitized build is the fastattn that gets imported.  Left out: the
# resident-memory test (ASan's quarantine holds freed memory on purpose) and
# the PyTorch comparison (torch is not installed here).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/fastattn-sanitize.XXXXXX")
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check numpy Cython "setuptools>=77" wheel pytest pytest-xdist hypothesis ml_dtypes

# A copy of the sources without the products of an earlier build, which
# setuptools would otherwise take as up to date.
mkdir "$work/src"
tar -C "$repo" --exclude=./.git --exclude=./build --exclude='*.egg-info' --exclude='*.so' \
    --exclude=./fastattn/_core.c -cf - . | tar -C "$work/src" -xf -
FASTATTN_SANITIZE=address,undefined "$py" -m pip install -q --disable-pip-version-check \
    --no-build-isolation "$work/src"

so=$(ls "$work"/venv/lib/python3*/site-packages/fastattn/_core*.so)
if ! ldd "$so" | grep libasan >/dev/null; then  # not -q: pipefail would see ldd's SIGPIPE
    echo "sanitize: $so is not linked with libasan; the sanitizer flags were not applied" >&2
    exit 1
fi

echo "sanitize: venv and sanitized build ready after $SECONDS s"

cp -r "$repo/tests" "$repo/examples" "$repo/README.md" "$work/"  # tests load examples/, README
cd "$work"
# CPython frees not everything at exit by design: leak detection stays off.
# An allocation too large to satisfy returns NULL, as it does without ASan
# (a test asks for a cache of petabytes and expects MemoryError).
# --capture=sys: a report written to file descriptor 2 reaches the log even
# though it ends the process.
# -n auto: a pytest-xdist worker per core; a report that ends a worker fails
# its test and the run.
LD_PRELOAD=$(gcc -print-file-name=libasan.so) \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$work/venv/bin/pytest" -q -n auto -p no:cacheprovider --capture=sys tests \
    --ignore=tests/test_leaks.py --ignore=tests/test_torch.py
