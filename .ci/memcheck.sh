#!/usr/bin/env bash
# CI: a short valgrind memcheck run of every kernel with the regular build
# (the fastattn that README's install command put in place).  memcheck finds
# reads of memory that was never written, which AddressSanitizer does not
# (.ci/sanitize.sh covers out-of-bounds access and undefined behaviour on the
# whole test suite).  Any report fails.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v valgrind >/dev/null; then
    echo "memcheck: installing valgrind"
    apt-get update -qq && apt-get install -y -qq valgrind >/dev/null
fi
# the interpreter itself, not a launcher script (pyenv's shims are bash)
py=$(python3 -c 'import sys; print(sys.executable)')
cd "$(mktemp -d)"  # away from the source tree: import the installed package
PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=99 --leak-check=no \
    --suppressions="$here/memcheck.supp" -q "$py" "$here/memcheck.py"
