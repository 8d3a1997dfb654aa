"""What import sets up.  FASTATTN_SIMD: a bad value warns and falls back,
never stops the import (``fastattn info`` must still run to show what the
CPU has).  OpenMP's idle threads spin briefly unless the user chose."""
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import pytest

import fastattn
from fastattn import _core, _runtime, _wait_policy

# Imports fastattn recording every warning, and prints what it saw.
IMPORT = """
import json, warnings
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import fastattn
print(json.dumps({"path": fastattn.simd_path(), "available": fastattn.available_simd_paths(),
                  "warnings": [(w.category.__name__, str(w.message)) for w in seen]}))
"""


def import_with(value):
    with tempfile.TemporaryDirectory() as cwd:  # outside the source tree: the installed package
        r = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True,
                           timeout=120, cwd=cwd, env=dict(os.environ, FASTATTN_SIMD=value))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("value", ["avx3", "sse9", "AVX-512", "none"])
def test_unknown_simd_env_warns_once_and_takes_the_widest(value):
    seen = import_with(value)
    assert seen["path"] == seen["available"][-1]
    assert len(seen["warnings"]) == 1, seen["warnings"]
    category, message = seen["warnings"][0]
    assert category == "RuntimeWarning"
    assert f"FASTATTN_SIMD={value.lower()!r} is not a SIMD path" in message
    assert "accepted: 'auto', 'portable', 'avx2', 'avx512', 'neon'" in message
    assert f"using {seen['path']!r}" in message


def test_unavailable_simd_env_warns_once_and_takes_the_widest():
    missing = [p for p in ("avx2", "avx512", "neon") if p not in fastattn.available_simd_paths()]
    if not missing:
        pytest.skip("this CPU runs every path (test_choose_path covers the case)")
    seen = import_with(missing[0])
    assert seen["path"] == seen["available"][-1]
    assert [c for c, _ in seen["warnings"]] == ["RuntimeWarning"]
    assert "a path this CPU or build cannot run" in seen["warnings"][0][1]


INT8_DOT = """
import json, warnings
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from fastattn import _runtime
print(json.dumps({"dot": _runtime.int8_dot(), "warnings": [str(w.message) for w in seen]}))
"""


@pytest.mark.parametrize("value, dot, warned", [
    ("auto", True, False), ("", True, False), (" OFF ", False, False), ("no", True, True)])
def test_int8_dot_env(value, dot, warned):
    """FASTATTN_INT8_DOT=off: the int8 mode sums without the CPU's
    dot-product instruction; anything but auto or off warns once."""
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", INT8_DOT], capture_output=True, text=True,
                           timeout=120, cwd=cwd, env=dict(os.environ, FASTATTN_INT8_DOT=value))
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["dot"] is dot
    assert seen["warnings"] == ([f"FASTATTN_INT8_DOT={value.strip().lower()!r} is not 'auto' or "
                                 "'off'; using 'auto'"] if warned else [])


@pytest.mark.parametrize("value", ["portable", " Portable ", "auto", ""])
def test_valid_simd_env_is_silent(value):
    seen = import_with(value)
    assert seen["warnings"] == []
    assert seen["path"] == ("portable" if "ortable" in value else seen["available"][-1])


@pytest.mark.parametrize("wanted,available,path,warned", [
    ("avx512", ["portable", "avx2"], "avx2", "'avx512' is a path this CPU or build cannot run"),
    ("avx2", ["portable"], "portable", "'avx2' is a path this CPU or build cannot run"),
    ("avx2", ["portable", "avx2", "avx512"], "avx2", None),
    ("AUTO", ["portable", "avx2"], "avx2", None),
    ("avx", ["portable", "avx2"], "avx2", "'avx' is not a SIMD path"),
    ("neon", ["portable", "avx2"], "avx2", "'neon' is a path this CPU or build cannot run"),
    ("neon", ["portable", "neon"], "neon", None),
    ("avx2", ["portable", "neon"], "neon", "'avx2' is a path this CPU or build cannot run"),
])
def test_choose_path(wanted, available, path, warned):
    """The choice for a CPU with the given paths, whatever this one has."""
    chosen, warning = _runtime._choose_path(wanted, available)
    assert chosen == path
    if warned is None:
        assert warning is None
    else:
        assert warned in warning and f"this CPU runs {', '.join(available)}" in warning
        assert f"using {path!r}" in warning


def test_set_simd_path_still_raises():
    """The explicit call keeps its errors: the caller asked for that path."""
    with pytest.raises(ValueError, match="unknown SIMD path 'avx3'"):
        fastattn.set_simd_path("avx3")
    for p in ("avx2", "avx512", "neon"):
        if p not in fastattn.available_simd_paths():
            with pytest.raises(RuntimeError, match=f"SIMD path '{p}' is not available"):
                fastattn.set_simd_path(p)


def test_paths_follow_the_machine():
    """x86-64 gets its AVX paths (where the CPU has them), aarch64 the NEON
    path (every aarch64 CPU Linux runs on has Advanced SIMD), and neither
    the other's; the half-precision features are reported only beside NEON."""
    machine = platform.machine().lower()
    paths = fastattn.available_simd_paths()
    assert paths[0] == "portable"
    if machine in ("aarch64", "arm64"):
        assert paths == ["portable", "neon"] and fastattn.simd_path() in paths
    else:
        assert "neon" not in paths
        assert not _core.cpu_has_neon_fp16() and not _core.cpu_has_neon_bf16()
    if machine not in ("x86_64", "amd64"):
        assert "avx2" not in paths and "avx512" not in paths


# OpenMP's idle threads (fastattn/_wait_policy.py): libgomp reads
# GOMP_SPINCOUNT when the extension loads it; omp_display_env(1) prints
# what it read.
SPIN_CHILD = r"""
import ctypes, ctypes.util, os, sys
import fastattn
print("GOMP_SPINCOUNT" in os.environ, flush=True)
if fastattn.openmp_enabled():
    ctypes.CDLL("libgomp.so.1").omp_display_env(1)
"""


def _spin_count(env):
    r = subprocess.run([sys.executable, "-c", SPIN_CHILD], capture_output=True, text=True,
                       env=env, cwd=tempfile.gettempdir(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"] or "GOMP_SPINCOUNT" in env, r.stdout  # taken back
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", r.stderr)
    if not fastattn.openmp_enabled() or found is None:
        pytest.skip("no libgomp (a serial build, or another OpenMP runtime)")
    return found.group(1)


def test_short_spin_by_default():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    assert _spin_count(env) == _wait_policy.SPIN_COUNT


@pytest.mark.parametrize("setting", [{"GOMP_SPINCOUNT": "123"},
                                     {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_a_users_wait_policy_stands(setting):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    spin = _spin_count(dict(env, **setting))
    assert spin != _wait_policy.SPIN_COUNT
    if "GOMP_SPINCOUNT" in setting:
        assert spin == "123"


def test_set_simd_path_reads_names_as_the_environment_does():
    before = fastattn.simd_path()
    try:
        fastattn.set_simd_path(" PORTABLE ")
        assert fastattn.simd_path() == "portable"
    finally:
        fastattn.set_simd_path(before)
