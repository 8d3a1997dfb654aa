#!/usr/bin/env bash
# CI: the documentation site, built as a reader on a fresh machine builds it:
# in a new venv holding only the checkout (pip install .) and
# docs/requirements.txt, with warnings as errors.  A page or an API name that
# needs a package those files do not install fails here, as it would for the
# reader.  Every Python block of the pages runs while it builds
# (docs/_ext/run_examples.py; the torch ones are skipped, as torch is not in
# docs/requirements.txt) and the figures are drawn from the benchmark
# records, so a stale example or record fails here too.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/fastattn-docs.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# one resolver run for both: fastattn is built from the checkout (an
# in-tree build whose objects are current is reused by setuptools)
"$work/venv/bin/pip" install --quiet --disable-pip-version-check "$repo" \
    -r "$repo/docs/requirements.txt" >"$work/install.log" 2>&1 \
    || { tail -30 "$work/install.log"; exit 1; }
echo "docs: a venv of the checkout and docs/requirements.txt after $SECONDS s"
cd "$repo"
rm -rf docs/_build docs/generated
"$work/venv/bin/sphinx-build" -W -q -b html docs docs/_build/html
echo "docs: built docs/_build/html ($(find docs/_build/html -name '*.html' | wc -l) pages)" \
     "after $SECONDS s"
