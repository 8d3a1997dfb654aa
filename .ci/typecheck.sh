#!/usr/bin/env bash
# Static types: mypy (major version 2 pinned) over the library as
# `import fastattn` loads it and over tests/typing_usage.py, with the
# settings of mypy.ini (strict, warn_unreachable, extra error codes).  It
# reads the source tree (the compiled extension through fastattn/_core.pyi),
# so it needs no build; NumPy must be installed, for its type stubs.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore 'mypy>=2,<3'
python -m mypy --version
python -m mypy --config-file mypy.ini
