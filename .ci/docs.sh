#!/usr/bin/env bash
# CI: the documentation site, built as a reader builds it, with warnings as
# errors.  Every Python block of its pages runs while it builds
# (docs/_ext/run_examples.py) and its figures are drawn from the benchmark
# records, so a stale example or record fails here.  Uses the fastattn that
# README's install command put in place.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    -r docs/requirements.txt
rm -rf docs/_build docs/generated
sphinx-build -W -q -b html docs docs/_build/html
echo "docs: built docs/_build/html ($(find docs/_build/html -name '*.html' | wc -l) pages)"
