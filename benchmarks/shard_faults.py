"""Faults of a ShardedKVCache's shards and snapshots, one line each.

    python benchmarks/shard_faults.py              # every fault
    python benchmarks/shard_faults.py --quick      # fewer: about 40 s

Process faults: SIGKILL and SIGSTOP of one shard's process while the cache
runs attend, append, snapshot (over an older snapshot at the same path) and
restore.  The signal is sent from a timer a fraction of the call's healthy
duration after the call starts, so it lands during the call (a line says
when the call had already ended).  A stopped process is resumed once the
line is written (or after a watchdog of 4 x timeout, for a build whose calls
never time out), so Ray can end it.

Snapshot damage: a snapshot, copied afresh for each fault, gets each file
truncated to half, one bit flipped in each file (in a shard file's middle,
its data, and in its zip header's time field, which no reader checks),
shard files swapped, a shard file from a later snapshot, a shard file
missing, a shard file or the cache.json of another cache of the same
arguments and length; then restore is asked to take it.

Each line: the fault; the outcome (the error's type and the head of its
message, or that the call returned, with an answer judged right or wrong
against float64); and after: whether the cache answered right next (or, for
damage, bit for bit as before the restore), whether the older snapshot at
the path restores, and whether a restore brought the cache back.

Starts its own Ray cluster of 2 CPUs, works in a temporary folder, and
removes both.  About two minutes on 2 cores.  Exits 1 if any fault gave a
wrong answer or left a snapshot that does not restore.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from functools import partial
from typing import Any, Callable, cast

import numpy as np

try:
    import ray
except ImportError:
    sys.exit("benchmarks/shard_faults.py needs Ray: pip install 'fastattn[ray]'")

from fastattn import reference
from fastattn.distributed import ShardedKVCache

HKV, HQ, E, CHUNK, SHARDS = 2, 4, 64, 64, 3
BASE, MORE, QUERIES = 40_000, 20_000, 64  # positions in the snapshot, appended, queried
VICTIM = 1  # the shard signalled


class Faults:
    def __init__(self, folder: str, timeout: float) -> None:
        rng = np.random.default_rng(0)
        total = BASE + 2 * MORE
        self.key = rng.standard_normal((HKV, total, E)).astype(np.float32)
        self.value = rng.standard_normal((HKV, total, E)).astype(np.float32)
        self.query = rng.standard_normal((HQ, QUERIES, E)).astype(np.float32)
        self.folder, self.timeout, self.bad = folder, timeout, 0
        self.args: dict[str, Any] = dict(capacity_per_shard=(total // SHARDS // CHUNK + 2) * CHUNK,
                                         chunk_size=CHUNK, num_cpus_per_shard=0.3,
                                         timeout=timeout)
        self.cache = ShardedKVCache(SHARDS, HKV, E, **self.args)
        self.append(0, BASE)
        self.base = self.path("base")
        self.cache.snapshot(self.base)
        self.cache.append(self.key[:, BASE:BASE + MORE], self.value[:, BASE:BASE + MORE])
        self.later = self.path("later")  # BASE + MORE positions
        self.cache.snapshot(self.later)
        with ShardedKVCache(SHARDS, HKV, E, **self.args) as other:  # same arguments and length
            other.append(self.value[:, :BASE], self.key[:, :BASE])
            self.other = self.path("other")
            other.snapshot(self.other)
        self.cache.restore(self.base)

    def head(self, exc: BaseException) -> str:
        """The error's type and the head of its message, without the folder."""
        text = " ".join(str(exc).split()).replace(self.folder + os.sep, "")
        return f"{type(exc).__name__}: {text[:110]}{'...' if len(text) > 110 else ''}"

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def append(self, a: int, b: int) -> None:
        self.cache.append(self.key[:, a:b], self.value[:, a:b])

    def judge(self, out: np.ndarray) -> str:
        """The answer against float64 attention over the positions held."""
        n = self.cache.length
        want = reference.scaled_dot_product_attention(
            self.query.astype(np.float64), self.key[:, :n].astype(np.float64),
            self.value[:, :n].astype(np.float64), is_causal=True,
            causal_alignment="lower_right", enable_gqa=True)
        err = float(np.abs(out - want).max())
        if err < 1e-4:
            return f"right ({err:.0e})"
        self.bad += 1
        return f"WRONG (max |err| {err:.3g})"

    def answer(self) -> str:
        try:
            return self.judge(cast(np.ndarray, self.cache.attend(self.query)))
        except Exception as exc:  # noqa: BLE001 - reported
            return self.head(exc)

    def restored(self, path: str) -> str:
        """Whether a restore from path brings the cache back, answering right."""
        try:
            self.cache.restore(path)
        except Exception as exc:  # noqa: BLE001 - reported
            self.bad += 1
            return f"FAILS: {self.head(exc)}"
        return self.answer()

    # ---- faults of a shard's process ------------------------------------
    def calls(self) -> dict[str, Callable[[], Any]]:
        snap = self.path("snap")
        return {"attend": lambda: self.cache.attend(self.query),
                "append": lambda: self.append(BASE, BASE + MORE),
                "snapshot": lambda: self.cache.snapshot(snap),
                "restore": lambda: self.cache.restore(self.later)}

    def process_fault(self, sig: signal.Signals, name: str, call: Callable[[], Any],
                      duration: float) -> str:
        self.cache.restore(self.base)
        if name == "snapshot":  # an older snapshot there, which must survive
            shutil.rmtree(self.path("snap"), ignore_errors=True)
            self.cache.snapshot(self.path("snap"))
        actor = self.cache._actors[VICTIM]
        pid = ray.get(actor.__ray_call__.remote(lambda shard: os.getpid()))
        delay = 0.3 * duration
        timer = threading.Timer(delay, os.kill, [pid, sig])
        watchdog = threading.Timer(4 * self.timeout + delay, resume, [pid])
        start = time.perf_counter()
        timer.start()
        watchdog.start()
        try:
            result = call()
            took = time.perf_counter() - start
            outcome = (f"returned in {took:.1f} s"
                       + (f", {self.judge(result)}" if name == "attend" else ""))
        except Exception as exc:  # noqa: BLE001 - reported
            took = time.perf_counter() - start
            outcome = f"{self.head(exc)} [{took:.1f} s]"
        timer.join()
        if took < delay:
            outcome += " (the call ended before the signal)"
        after = f"next attend: {self.answer()}"
        resume(pid)  # a stopped process ends at once when resumed
        watchdog.cancel()
        if name == "snapshot":
            after += f"; older snapshot at the path: {self.restored(self.path('snap'))}"
        after += f"; restore: {self.restored(self.base)}"
        return f"{sig.name} shard {VICTIM} during {name} (at {delay:.2f} s) | {outcome} | {after}"

    # ---- damaged snapshots ----------------------------------------------
    def damages(self) -> list[tuple[str, Callable[[str], object]]]:
        files = ["cache.json"] + [f"shard-{k}.npz" for k in range(SHARDS)]
        kinds: list[tuple[str, Callable[[str], object]]] = []
        for f in files:
            kinds.append((f"{f} truncated to half", partial(truncate, name=f)))
        for f in files:
            kinds.append((f"{f} one bit flipped mid-file", partial(flip, name=f, at=None)))
            if f != "cache.json":
                kinds.append((f"{f} one bit flipped in its zip header's time",
                              partial(flip, name=f, at=10)))
        kinds += [
            ("shard-0.npz and shard-1.npz swapped", swap),
            ("shard-1.npz from a later snapshot",
             lambda s: shutil.copy(os.path.join(self.later, "shard-1.npz"), s)),
            ("shard-2.npz missing", lambda s: os.remove(os.path.join(s, "shard-2.npz"))),
            ("shard-1.npz of another cache (same arguments, length)",
             lambda s: shutil.copy(os.path.join(self.other, "shard-1.npz"), s)),
            ("cache.json of another cache (same arguments, length)",
             lambda s: shutil.copy(os.path.join(self.other, "cache.json"), s)),
        ]
        return kinds

    def damage_fault(self, name: str, harm: Callable[[str], object]) -> str:
        snap = self.path("damaged")
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(self.base, snap)
        harm(snap)
        self.cache.restore(self.later)  # a cache that is not the snapshot's
        before = self.cache.attend(self.query)
        try:
            self.cache.restore(snap)
            outcome = f"accepted, {self.answer()}"
        except Exception as exc:  # noqa: BLE001 - reported
            outcome = self.head(exc)
            try:
                same = np.array_equal(self.cache.attend(self.query), before)
                after = "cache as it was, bit for bit" if same else "cache CHANGED"
            except Exception as exc2:  # noqa: BLE001 - reported
                after = f"cache: {self.head(exc2)}"
            if after != "cache as it was, bit for bit":
                self.bad += 1
        else:
            after = "-"
        after += f"; restore: {self.restored(self.base)}"
        return f"snapshot damaged: {name} | {outcome} | {after}"


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def truncate(snap: str, name: str) -> None:
    path = os.path.join(snap, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip(snap: str, name: str, at: int | None) -> None:
    path = os.path.join(snap, name)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if at is None else at] ^= 1
    open(path, "wb").write(bytes(data))


def swap(snap: str) -> None:
    a, b = (os.path.join(snap, f"shard-{k}.npz") for k in (0, 1))
    os.replace(a, a + ".x")
    os.replace(b, a)
    os.replace(a + ".x", b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="the cache's timeout in seconds (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="append and snapshot only, and the damage of shard-1.npz, a "
                             "missing file and another cache's files")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="shard-faults-")
    here = os.getcwd()
    os.chdir(folder)  # Ray's workers import from the driver's folder first: not a source tree
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    finally:
        os.chdir(here)
    started = time.perf_counter()
    try:
        faults = Faults(folder, args.timeout)
        print(f"{SHARDS} shards, {BASE} positions in the snapshot (+{MORE} per append), "
              f"{HKV} key/value heads of {E}, {QUERIES} queries, timeout {args.timeout:g} s; "
              f"shard {VICTIM} is signalled")
        print("fault | outcome | after")
        durations = {}
        for name, call in faults.calls().items():  # healthy durations, to land the signals
            faults.cache.restore(faults.base)
            start = time.perf_counter()
            call()
            durations[name] = time.perf_counter() - start
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            for name, call in faults.calls().items():
                if not args.quick or name in ("append", "snapshot"):
                    print(faults.process_fault(sig, name, call, durations[name]), flush=True)
        for name, harm in faults.damages():
            if not args.quick or "shard-1" in name or "missing" in name or "another" in name:
                print(faults.damage_fault(name, harm), flush=True)
        faults.cache.close()
        print(f"{time.perf_counter() - started:.0f} s; faults with a wrong answer or a "
              f"snapshot that did not restore: {faults.bad}")
        return 1 if faults.bad else 0
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
