"""How long OpenMP's idle threads spin before they sleep, chosen as the
extension loads OpenMP.

libgomp's threads spin at the end of each parallel loop, and while they wait
for the next, before they sleep: by default 300,000 pause instructions, tens
of milliseconds.  On a machine where another process keeps one core busy, a
thread that spins there loses its time slices to that process and the call
waits for it.  A short spin keeps threads that wake at once for back-to-back
calls, and lets them sleep when nothing comes (docs/guide/threads-and-speed.md,
"Shared machines" and "Spin count", has the measurements).

libgomp reads GOMP_SPINCOUNT once, when it is loaded, so the variable is
set only while the extension loads it and then taken back: child processes
keep their defaults.  A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as
it is.  The process has one libgomp (PyTorch's bundled libgomp.so.1 is the
same library to the loader): when torch is imported first, its setting
stands for fastattn too; when fastattn is, torch's threads spin briefly too.
"""
import contextlib
import os
from typing import Iterator

SPIN_COUNT = "4000"


@contextlib.contextmanager
def short_spin() -> Iterator[None]:
    """GOMP_SPINCOUNT=SPIN_COUNT inside the block, unless the user chose."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        yield
    finally:
        del os.environ["GOMP_SPINCOUNT"]
