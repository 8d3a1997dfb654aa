"""Process-wide choices: the instruction-set path and the thread count.

The C kernels hold no state; these settings are read by the Python layer at
each call and passed down, so changing them from one thread never disturbs a
call already running in another.
"""
from __future__ import annotations

import operator
import os
import warnings
from typing import Optional

from . import _core

_PATHS = {"portable": _core.ISA_PORTABLE, "avx2": _core.ISA_AVX2, "avx512": _core.ISA_AVX512,
          "neon": _core.ISA_NEON}
SIMD_ENV = "FASTATTN_SIMD"


def available_simd_paths() -> list[str]:
    """The instruction-set paths this CPU and build can run, best last."""
    paths = ["portable"]
    if _core.cpu_has_avx2_fma():
        paths.append("avx2")
    if _core.cpu_has_avx512():
        paths.append("avx512")
    if _core.cpu_has_neon():
        paths.append("neon")
    return paths


def _choose_path(wanted: str, available: list[str]) -> tuple[str, Optional[str]]:
    """The path for FASTATTN_SIMD=wanted on a CPU that runs available (best
    last), and the warning to give, or None.  An unknown name or a path the
    CPU lacks falls back to the widest available path: an environment
    variable must not stop the import (``fastattn info`` included)."""
    wanted = wanted.strip().lower() or "auto"
    widest = available[-1]
    if wanted == "auto":
        return widest, None
    if wanted in available:
        return wanted, None
    why = ("is not a SIMD path" if wanted not in _PATHS
           else "is a path this CPU or build cannot run")
    return widest, (f"{SIMD_ENV}={wanted!r} {why}; accepted: 'auto', 'portable', 'avx2', "
                    f"'avx512', 'neon' (this CPU runs {', '.join(available)}); using {widest!r}")


def _path_from_env() -> str:
    path, warning = _choose_path(os.environ.get(SIMD_ENV, "auto"), available_simd_paths())
    if warning is not None:
        warnings.warn(warning, RuntimeWarning, stacklevel=2)
    return path


_simd_path = _path_from_env()
# FASTATTN_INT8_DOT=off: the int8 mode's integer products without the CPU's
# dot-product instruction (AVX-512 VNNI, AVX-VNNI, ARMv8.2 sdot), as on a CPU
# that lacks it: the same exact sums, so the same results (for testing)
INT8_DOT_ENV = "FASTATTN_INT8_DOT"


def _int8_dot_from_env() -> bool:
    value = os.environ.get(INT8_DOT_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        warnings.warn(f"{INT8_DOT_ENV}={value!r} is not 'auto' or 'off'; using 'auto'",
                      RuntimeWarning, stacklevel=2)
    return value != "off"


_int8_dot = _int8_dot_from_env()
_num_threads: Optional[int] = None  # None: OpenMP's default (OMP_NUM_THREADS, else the CPU count)
MAX_THREADS = _core.MAX_THREADS  # OpenMP aborts when it cannot create a thread


def simd_path() -> str:
    """Name of the instruction-set path in use: 'avx512', 'avx2' or 'portable'
    on x86-64, 'neon' or 'portable' on aarch64.

    Chosen at import from the CPU's features (the widest it has), or forced
    with the environment variable FASTATTN_SIMD=portable|avx2|avx512|neon|auto.
    A value that is not a path, or a path this CPU cannot run, gives one
    RuntimeWarning at import and the widest path instead.  On 'avx512',
    decoding (at most 4 query rows) whose E or Ev is not a multiple of 16
    float32 or 8 float64 runs the AVX2 kernels, which are faster there, and
    gives their bits (the guide "Speed and threads")."""
    return _simd_path


def set_simd_path(name: str) -> None:
    """Switch the instruction-set path ('portable', 'avx2', 'avx512', 'neon' or
    'auto').

    Raises
    ------
    TypeError
        A name that is not a str.
    ValueError
        An unknown name.
    RuntimeError
        A path this CPU cannot run.
    """
    global _simd_path
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    name = name.strip().lower()  # as FASTATTN_SIMD is read
    if name == "auto":
        name = available_simd_paths()[-1]
    if name not in _PATHS:
        raise ValueError(f"unknown SIMD path {name!r}: expected 'auto', 'portable', 'avx2', "
                         "'avx512' or 'neon'")
    if name not in available_simd_paths():
        raise RuntimeError(f"SIMD path {name!r} is not available on this CPU or build")
    _simd_path = name


def isa() -> int:
    return _PATHS[_simd_path]


def int8_dot() -> bool:
    """False when FASTATTN_INT8_DOT=off asks the int8 mode not to use the
    CPU's dot-product instruction."""
    return _int8_dot


def openmp_enabled() -> bool:
    """True when the extension was compiled with OpenMP."""
    return _core.have_openmp()


def _check_threads(n: object, name: str) -> int:
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}"
                         + ("; None (the default) means get_num_threads()" if name == "num_threads"
                            else "; None restores OpenMP's default"))
    if n > MAX_THREADS:
        raise ValueError(f"{name} must be <= {MAX_THREADS} (OpenMP aborts the process when it "
                         f"cannot create a thread), got {n}")
    return n


def set_num_threads(n: Optional[int]) -> None:
    """Set the number of threads the kernels use (1 <= n <= MAX_THREADS,
    which is max(1024, CPU count)), or None for OpenMP's default
    (OMP_NUM_THREADS when set, else the number of CPUs).  Without OpenMP in
    the build every call runs on one thread.  Calls already running keep the
    count they started with.

    Raises
    ------
    TypeError
        A count that is not an int (bool and float included).
    ValueError
        A count out of range.
    """
    global _num_threads
    _num_threads = None if n is None else _check_threads(n, "n")


# libgomp's thread pool does not survive fork(): in a child forked after the
# parent ran a parallel call, a team of 2 or more threads waits forever for
# threads that do not exist there (multiprocessing's default start method on
# Linux).  Such a child runs every call on its one thread.
_team_started = False  # this process ran a call on more than one thread
_forked_after_team = False


def _after_fork_in_child() -> None:
    global _forked_after_team
    _forked_after_team = _forked_after_team or _team_started


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def get_num_threads() -> int:
    """The number of threads a call uses when it is not given num_threads:
    the count set by set_num_threads, else OpenMP's default capped at
    MAX_THREADS (so that OMP_NUM_THREADS=100000 cannot abort the process).
    1 without OpenMP, and in a process forked after its parent ran a call
    on several threads (OpenMP's threads do not survive fork)."""
    if not _core.have_openmp() or _forked_after_team:
        return 1
    n = _num_threads  # read once: another thread may reset it meanwhile
    return n if n is not None else min(_core.omp_max_threads(), MAX_THREADS)


def resolve_threads(num_threads: Optional[int]) -> int:
    """Thread count for one call: the argument if given, else the global one
    (1 where get_num_threads says so, whatever the argument)."""
    global _team_started
    if num_threads is None:
        n = get_num_threads()  # 1 already where a team cannot run
    elif type(num_threads) is int and 1 <= num_threads <= MAX_THREADS:  # the common count
        n = num_threads
    else:
        n = _check_threads(num_threads, "num_threads")
    if n > 1:
        if not _core.have_openmp() or _forked_after_team:
            return 1
        _team_started = True
    return n
