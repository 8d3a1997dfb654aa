"""fastattn.distributed on a local Ray cluster started here: sharded caches
and sharded prefill against one process's attention, lost shards,
snapshots, and nothing left behind."""
import gc
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import assert_close, f64

ray = pytest.importorskip("ray")

import fastattn  # noqa: E402
from fastattn import reference as ref  # noqa: E402
from fastattn.distributed import (ShardedKVCache, ShardLostError, ShardTimeoutError,  # noqa: E402
                                  sharded_attention)

# A merged result differs from one process's call only by where the blocks
# of the online softmax end and by the merge's roundings (a weight exp(lse_p
# - lse) and a sum per level): measured at most 1.4 eps x max|value| for the
# output and 1.4 eps x max(1, |lse|) for the log-sum-exp, over 2-4 shards and
# chunks of 16-256 positions.  Tested at 8 eps.
ULPS = 8
CPUS = 0.5  # four shards fit in the two CPUs of the test cluster


def start_ray(folder):
    # Ray's workers start in the driver's folder and import from it first:
    # in the repository, that would be the source tree, which has no
    # compiled extension (README: run Python from outside it)
    here = os.getcwd()
    os.chdir(folder)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    finally:
        os.chdir(here)


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    start_ray(tmp_path_factory.mktemp("ray"))
    yield
    ray.shutdown()


def close_to_one_process(got, want, value, dtype):
    """got within ULPS eps of want (one process's result), scaled by the values."""
    eps = np.finfo(np.float32 if np.dtype(dtype).itemsize <= 4 else np.float64).eps
    bound = ULPS * eps * max(1.0, float(np.abs(value).max(initial=0)))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0,
                               atol=bound)


def lse_close(got, want):
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    eps = np.finfo(got.dtype).eps
    np.testing.assert_allclose(got[fin], want[fin], rtol=ULPS * eps, atol=ULPS * eps)


def options(rng, Hq, kind):
    return {"plain": {}, "window": dict(window_size=(37, 0)),
            "alibi": dict(alibi_slopes=rng.random(Hq) * 0.3),
            "sinks+softcap": dict(sinks=rng.standard_normal(Hq), softcap=5.0),
            "all": dict(window_size=(90, 3), alibi_slopes=rng.random(Hq) * 0.1,
                        sinks=rng.standard_normal(Hq), softcap=30.0, scale=0.3),
            "not causal": dict(is_causal=False)}[kind]


@pytest.mark.parametrize("storage,dtype", [("float32", np.float32), ("int8", np.float32),
                                           ("float16", np.float32), ("bfloat16", np.float32),
                                           ("int4", np.float32), ("float8_e4m3fn", np.float32),
                                           ("float64", np.float64)])
def test_cache_equals_one_process(storage, dtype):
    """Every option and storage: the sharded cache gives one KVCache's result
    on the same stored values, after a prefill and decoding steps of 6 and 1
    queries.  (One cache per storage: each shard is a process to start.)"""
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(len(storage))
    Hkv, Hq, E, Ev, S = 2, 4, 16, 8, 700
    k = rng.standard_normal((Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((Hkv, S, Ev)).astype(dtype)
    one = fastattn.KVCache(1, Hkv, S + 10, E, value_dim=Ev, dtype=dtype, storage=storage)
    with ShardedKVCache(3, Hkv, E, value_dim=Ev, capacity_per_shard=300, chunk_size=64,
                        dtype=dtype, storage=storage, num_cpus_per_shard=CPUS) as cache:
        for a, b in [(0, 500), (500, 506), (506, 507)]:  # a prefill, then steps
            cache.append(k[:, a:b], v[:, a:b])
            one.append(k[None, :, a:b], v[None, :, a:b])
            L = b - a if b - a < 10 else 1
            for kind in ["plain", "window", "alibi", "sinks+softcap", "all", "not causal"]:
                q = rng.standard_normal((Hq, L, E)).astype(dtype)
                opts = options(rng, Hq, kind)
                out, lse = cache.attend(q, return_lse=True, **opts)
                want, want_lse = one.attend(q[None], return_lse=True, **opts)
                close_to_one_process(out, want[0], v, dtype)
                lse_close(lse, want_lse[0])
        assert cache.length == 507 and sum(cache.shard_lengths) == 507


def test_16_bit_queries_are_rounded_once():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 400, 8)).astype(np.float32)
    one = fastattn.KVCache(1, 2, 400, 8)
    one.append(k[None], k[None])
    with ShardedKVCache(2, 2, 8, capacity_per_shard=256, chunk_size=32,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k, k)
        for half in (np.float16, ml_dtypes.bfloat16):
            q = rng.standard_normal((4, 3, 8)).astype(half)
            out = cache.attend(q)
            assert out.dtype == np.dtype(half)
            # the float32 result rounded once: at most one rounding step apart
            want = one.attend(q[None].astype(np.float32))[0]
            step = np.finfo(half).eps * np.abs(want) + ULPS * np.finfo(np.float32).eps
            assert np.all(np.abs(out.astype(np.float32) - want) <= step)


def test_against_the_float64_reference_with_gqa_and_alibi():
    rng = np.random.default_rng(4)
    Hkv, Hq, E, S, L = 2, 6, 32, 1000, 4
    k, v = (rng.standard_normal((Hkv, S, E)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((Hq, L, E)).astype(np.float32)
    slopes = rng.random(Hq) * 0.05
    with ShardedKVCache(4, Hkv, E, capacity_per_shard=256, chunk_size=50,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k, v)
        out = cache.attend(q, alibi_slopes=slopes, window_size=(400, 0))
    want = ref.scaled_dot_product_attention(*f64(q, k, v), is_causal=True, enable_gqa=True,
                                            causal_alignment="lower_right", alibi_slopes=slopes,
                                            window_size=(400, 0))
    assert_close(out, want, np.float32, E + S, magnitude=float(np.abs(v).max()))


def test_positions_are_dealt_in_chunks_round_robin():
    with ShardedKVCache(3, 1, 4, capacity_per_shard=40, chunk_size=10,
                        num_cpus_per_shard=CPUS) as cache:
        x = np.zeros((1, 45, 4), np.float32)
        cache.append(x[:, :7], x[:, :7])
        cache.append(x[:, 7:45], x[:, 7:45])
        # chunks 0-9, 30-39 -> shard 0; 10-19, 40-44 -> 1; 20-29 -> 2
        assert cache.shard_lengths == [20, 15, 10]
        assert [cache.shard_of(p) for p in (0, 9, 10, 29, 30, 44)] == [0, 0, 1, 2, 0, 1]


def test_a_failed_append_writes_nothing_in_any_shard():
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 100, 8)).astype(np.float32)
    with ShardedKVCache(2, 2, 8, capacity_per_shard=64, chunk_size=16, storage="int8",
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k[:, :50], k[:, :50])
        q = rng.standard_normal((2, 1, 8)).astype(np.float32)
        before = cache.attend(q)
        bad = k[:, 50:90].copy()
        bad[1, 35, 2] = np.inf  # lands in shard 1; shard 0 takes its part first
        with pytest.raises(ValueError, match="non-finite|finite"):
            cache.append(bad, bad)
        assert cache.shard_lengths == [32, 18]
        with pytest.raises(ValueError, match="capacity exceeded: shard 0"):
            cache.append(k, k)
        assert cache.shard_lengths == [32, 18]
        np.testing.assert_array_equal(cache.attend(q), before)
        with pytest.raises(TypeError, match="dtype float64"):
            cache.append(k.astype(np.float64), k.astype(np.float64))
        with pytest.raises(ValueError, match=r"expected \(num_kv_heads, n, head_dim\)"):
            cache.append(k[0], k[0])
        with pytest.raises(ValueError, match="append their keys"):
            cache.attend(rng.standard_normal((2, 51, 8)).astype(np.float32))


def test_a_killed_shard_raises_until_restored(tmp_path):
    rng = np.random.default_rng(6)
    k = rng.standard_normal((2, 300, 8)).astype(np.float32)
    q = rng.standard_normal((4, 1, 8)).astype(np.float32)
    with ShardedKVCache(3, 2, 8, capacity_per_shard=128, chunk_size=32,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k, k)
        before = cache.attend(q)
        cache.snapshot(tmp_path / "snap")
        ray.kill(cache._actors[1])
        with pytest.raises(ShardLostError) as info:
            cache.attend(q)
        message = str(info.value)
        print(message)
        assert info.value.shards == [1] and info.value.positions == 96
        assert "shard 1 of 3 lost" in message and "32-63" in message and "restore" in message
        for call in (lambda: cache.attend(q), lambda: cache.append(k[:, :1], k[:, :1]),
                     lambda: cache.snapshot(tmp_path / "other")):
            with pytest.raises(ShardLostError, match="shard 1 of 3 lost"):
                call()
        cache.restore(tmp_path / "snap")
        np.testing.assert_array_equal(cache.attend(q), before)
        cache.append(k[:, :5], k[:, :5])  # and it goes on
        assert cache.length == 305


def test_snapshot_restores_into_a_new_cache(tmp_path):
    rng = np.random.default_rng(7)
    k = rng.standard_normal((1, 90, 4)).astype(np.float32)
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)
    args = dict(capacity_per_shard=64, chunk_size=8, storage="float16", num_cpus_per_shard=CPUS)
    with ShardedKVCache(2, 1, 4, **args) as cache:
        cache.append(k, k)
        want = cache.attend(q)
        cache.snapshot(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["cache.json", "shard-0.npz", "shard-1.npz"]
    with ShardedKVCache(2, 1, 4, **args) as again:
        again.restore(tmp_path)
        assert again.length == 90
        np.testing.assert_array_equal(again.attend(q), want)
    with ShardedKVCache(2, 1, 4, **dict(args, chunk_size=16)) as other:
        with pytest.raises(ValueError, match="chunk_size 8 there, 16 here"):
            other.restore(tmp_path)
        with pytest.raises(FileNotFoundError):
            other.restore(tmp_path / "missing")


def test_smoothed_rotated_shards(tmp_path):
    """smooth_k and rotate_k: each shard stores its keys less the mean of
    its first chunk and rotated; the merged result is the float64
    reference's (softcap and sinks see the true logits), and a snapshot
    restores only into a cache with the same options."""
    rng = np.random.default_rng(11)
    Hkv, Hq, E, S = 2, 4, 16, 300
    k = (rng.standard_normal((Hkv, S, E)) + 3 * rng.standard_normal(E)).astype(np.float32)
    v = rng.standard_normal((Hkv, S, E)).astype(np.float32)
    q = rng.standard_normal((Hq, 1, E)).astype(np.float32)
    opts = dict(sinks=rng.standard_normal(Hq), softcap=5.0)
    args = dict(capacity_per_shard=200, chunk_size=64, num_cpus_per_shard=CPUS)
    with ShardedKVCache(2, Hkv, E, smooth_k=True, rotate_k=True, **args) as cache:
        cache.append(k, v)
        out, lse = cache.attend(q, return_lse=True, **opts)
        want, want_lse = ref.scaled_dot_product_attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), enable_gqa=True,
            return_lse=True, **opts)
        bound = 8 * (E + S) * np.finfo(np.float32).eps * 30  # scores up to ~30
        np.testing.assert_allclose(out, want, rtol=0, atol=bound)
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=bound)
        cache.snapshot(tmp_path)
    with ShardedKVCache(2, Hkv, E, smooth_k=True, rotate_k=True, **args) as again:
        again.restore(tmp_path)
        np.testing.assert_array_equal(again.attend(q, **opts), out)
    with ShardedKVCache(2, Hkv, E, **args) as plain:
        with pytest.raises(ValueError, match="smooth_k"):
            plain.restore(tmp_path)


def all_cpus_free():
    """True once every CPU of the cluster is free (Ray returns a closed
    cache's CPUs asynchronously), within 20 s."""
    for _ in range(200):
        if ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]:
            return True
        time.sleep(0.1)
    return False


def test_close_leaves_no_actor_and_no_object():
    worker = ray._private.worker.global_worker
    assert all_cpus_free()
    gc.collect()  # earlier tests' garbage holds references it would release during this one
    objects = len(worker.core_worker.get_all_reference_counts())
    cache = ShardedKVCache(4, 2, 8, capacity_per_shard=32, chunk_size=8,
                           num_cpus_per_shard=CPUS)
    cache.append(np.ones((2, 100, 8), np.float32), np.ones((2, 100, 8), np.float32))
    cache.attend(np.ones((2, 1, 8), np.float32))
    assert ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]
    cache.close()
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.attend(np.ones((2, 1, 8), np.float32))
    assert all_cpus_free()
    gc.collect()
    assert len(worker.core_worker.get_all_reference_counts()) == objects


def test_unplaceable_shards_time_out_and_reserve_nothing():
    with pytest.raises(TimeoutError, match="could not place 2 shards of 0.5 CPU each "
                                           r"\(strict_spread\) within 2 s"):
        ShardedKVCache(2, 1, 4, capacity_per_shard=8, num_cpus_per_shard=CPUS, timeout=2,
                       placement="strict_spread")  # one node each: this cluster has one
    assert all_cpus_free()


@pytest.mark.parametrize("bad,exc,match", [
    (dict(placement="everywhere"), ValueError, "placement must be one of"),
    (dict(num_cpus_per_shard=0), ValueError, "num_cpus_per_shard must be > 0"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(storage="int2"), ValueError, "storage"),
    (dict(timeout=-1), ValueError, "timeout must be > 0"),
    (dict(timeout=float("nan")), ValueError, "timeout"),
    (dict(timeout="5"), TypeError, "timeout must be a real number"),
    (dict(capacity_per_shard=10**30), ValueError, "larger than any address space"),
    (dict(num_cpus_per_shard=1.5), ValueError, "need 3 CPUs; the Ray cluster has 2 in all"),
])
def test_bad_arguments_reserve_nothing(bad, exc, match):
    with pytest.raises(exc, match=match):
        ShardedKVCache(2, 1, 4, **dict(dict(capacity_per_shard=8), **bad))
    assert all_cpus_free()


def test_a_shard_that_cannot_start_is_an_error_at_once():
    with pytest.raises(RuntimeError, match="shard 0 could not start: .*MemoryError|could not be"):
        ShardedKVCache(2, 1, 4, capacity_per_shard=10**13, num_cpus_per_shard=CPUS)
    assert all_cpus_free()


def test_shard_of_checks_its_position():
    with ShardedKVCache(2, 1, 4, capacity_per_shard=8, chunk_size=4,
                        num_cpus_per_shard=CPUS) as cache:
        assert cache.shard_of(5) == 1
        with pytest.raises(ValueError, match="position must be >= 0"):
            cache.shard_of(-1)
        with pytest.raises(TypeError, match="position must be an int"):
            cache.shard_of(1.5)


def test_restore_is_all_or_nothing(tmp_path):
    """A snapshot that does not agree with itself or the cache is refused
    before any shard takes it, and the cache is left as it was."""
    rng = np.random.default_rng(8)
    k = rng.standard_normal((1, 30, 4)).astype(np.float32)
    q = rng.standard_normal((1, 1, 4)).astype(np.float32)
    with ShardedKVCache(3, 1, 4, capacity_per_shard=20, chunk_size=4,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k, k)
        want = cache.attend(q)
        good, bad = tmp_path / "good", tmp_path / "bad"
        cache.snapshot(good)
        cache.snapshot(bad)
        ray.kill(cache._actors[1])  # and restore before any call of the cache notices
        dead(cache._actors[1])  # (ray.kill returns before the process is gone)
        cache.restore(good)
        np.testing.assert_array_equal(cache.attend(q), want)

        meta = json.loads((bad / "cache.json").read_text())
        for edit, match in [(dict(meta, shard_lengths=[10, 12, 8]), "do not give"),
                            ([1, 2], "not a ShardedKVCache snapshot"),
                            (dict(meta, chunk_size=8), "chunk_size 8 there, 4 here")]:
            (bad / "cache.json").write_text(json.dumps(edit))
            with pytest.raises(ValueError, match=match):
                cache.restore(bad)
            np.testing.assert_array_equal(cache.attend(q), want)  # nothing changed
        (bad / "cache.json").write_text(json.dumps(meta))
        os.remove(bad / "shard-1.npz")
        with pytest.raises(FileNotFoundError, match="no shard-1.npz"):
            cache.restore(bad)
        np.testing.assert_array_equal(cache.attend(q), want)

        # runs edited by hand, the file's sha256 recorded: the positions are checked too
        shutil.copytree(good, bad, dirs_exist_ok=True)
        with np.load(good / "shard-0.npz") as saved:
            state = dict(saved)
        state["runs"] = state["runs"] + 1000
        np.savez(bad / "shard-0.npz", **state)
        meta = json.loads((good / "cache.json").read_text())
        meta["sha256"]["shard-0.npz"] = sha256(bad / "shard-0.npz")
        (bad / "cache.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match="shard-0.npz holds other positions"):
            cache.restore(bad)
        np.testing.assert_array_equal(cache.attend(q), want)  # every shard as it was
        (bad / "shard-0.npz").write_bytes(b"not a zip")
        with pytest.raises(ValueError, match="shard-0.npz cannot be read"):
            cache.restore(bad)
        np.testing.assert_array_equal(cache.attend(q), want)
        cache.restore(good)
        np.testing.assert_array_equal(cache.attend(q), want)


def dead(actor):
    """Waits, at most 30 s, until a killed actor's calls fail."""
    for _ in range(300):
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers")


def sha256(name):
    return hashlib.sha256(name.read_bytes()).hexdigest()


def shard_pid(cache, k):
    return ray.get(cache._actors[k].__ray_call__.remote(lambda shard: os.getpid()))


def test_a_snapshot_is_tied_to_its_files(tmp_path):
    """Every file carries the snapshot's id, cache.json each file's sha256:
    files of two caches of the same arguments and length do not mix, and
    a file rewritten with the right id is refused too."""
    rng = np.random.default_rng(10)
    k = rng.standard_normal((2, 1, 40, 4)).astype(np.float32)
    q = rng.standard_normal((1, 1, 4)).astype(np.float32)
    args = dict(capacity_per_shard=32, chunk_size=8, num_cpus_per_shard=CPUS)
    with ShardedKVCache(2, 1, 4, **args) as a, ShardedKVCache(2, 1, 4, **args) as b:
        for cache, keys, name in ((a, k[0], "a"), (b, k[1], "b")):
            cache.append(keys, keys)
            cache.snapshot(tmp_path / name)
        want = a.attend(q)
        a.append(k[0, :, :3], k[0, :, :3])
        now = a.attend(q)
        shutil.copy(tmp_path / "b" / "shard-1.npz", tmp_path / "a" / "shard-1.npz")
        with pytest.raises(ValueError, match="shard-1.npz is of snapshot [0-9a-f]{32}; "
                                             "cache.json is of snapshot"):
            a.restore(tmp_path / "a")
        np.testing.assert_array_equal(a.attend(q), now)
        shutil.copy(tmp_path / "b" / "cache.json", tmp_path / "a" / "cache.json")
        with pytest.raises(ValueError, match="shard-0.npz is of snapshot"):
            a.restore(tmp_path / "a")

        a.snapshot(tmp_path / "a")  # a shard file rewritten, same id, index and shapes
        with np.load(tmp_path / "a" / "shard-0.npz") as saved:
            state = dict(saved)
        state["key"] = state["key"] ^ np.uint32(1)
        np.savez(tmp_path / "a" / "shard-0.npz", **state)
        with pytest.raises(ValueError, match="shard-0.npz is damaged: its sha256 is "):
            a.restore(tmp_path / "a")
        b.restore(tmp_path / "b")
        b.append(k[0, :, :3], k[0, :, :3])
        assert not np.array_equal(b.attend(q), now)
        np.testing.assert_array_equal(a.attend(q), now)
    assert not np.array_equal(want, now)


def test_a_failed_restore_leaves_the_cache_as_it_was(tmp_path):
    """Damage found only when the shards read their files (truncated, of a
    later snapshot, swapped between shards) changes no shard."""
    rng = np.random.default_rng(11)
    k = rng.standard_normal((1, 60, 4)).astype(np.float32)
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)
    with ShardedKVCache(3, 1, 4, capacity_per_shard=32, chunk_size=4,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k[:, :40], k[:, :40])
        cache.snapshot(tmp_path / "early")
        cache.append(k[:, 40:50], k[:, 40:50])
        cache.snapshot(tmp_path / "later")
        cache.append(k[:, 50:], k[:, 50:])
        now, lengths = cache.attend(q), cache.shard_lengths
        snap = tmp_path / "early"
        damage = [
            (lambda: (snap / "shard-2.npz").write_bytes((tmp_path / "early.2").read_bytes()[:-9]),
             "shard-2.npz cannot be read"),
            (lambda: shutil.copy(tmp_path / "later" / "shard-1.npz", snap / "shard-1.npz"),
             "shard-1.npz is of snapshot .*: the file is from another snapshot"),
            (lambda: [os.replace(snap / "shard-0.npz", snap / "x"),
                      os.replace(snap / "shard-1.npz", snap / "shard-0.npz"),
                      os.replace(snap / "x", snap / "shard-1.npz")],
             "shard-0.npz holds shard 1's positions, not shard 0's"),
        ]
        shutil.copy(snap / "shard-2.npz", tmp_path / "early.2")
        for harm, match in damage:
            shutil.copytree(snap, tmp_path / "kept")
            harm()
            with pytest.raises(ValueError, match=match):
                cache.restore(snap)
            np.testing.assert_array_equal(cache.attend(q), now)
            assert cache.shard_lengths == lengths
            shutil.rmtree(snap)
            os.rename(tmp_path / "kept", snap)
        cache.restore(snap)  # undamaged, it restores
        assert cache.length == 40


def test_a_stopped_snapshot_leaves_the_older_one(tmp_path, monkeypatch):
    """A snapshot that fails part-way (a dead shard, a write error, a failed
    rename), or one stopped between its renames, leaves the older
    snapshot restorable at its path."""
    rng = np.random.default_rng(12)
    k = rng.standard_normal((2, 400, 16)).astype(np.float32)
    q = rng.standard_normal((2, 1, 16)).astype(np.float32)
    path = tmp_path / "snap"
    with ShardedKVCache(3, 2, 16, capacity_per_shard=200, chunk_size=16,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k[:, :300], k[:, :300])
        cache.snapshot(path)
        old = cache.attend(q)
        cache.append(k[:, 300:], k[:, 300:])

        ray.kill(cache._actors[1])
        with pytest.raises(ShardLostError, match="shard 1 of 3 lost"):
            cache.snapshot(path)
        cache.restore(path)
        np.testing.assert_array_equal(cache.attend(q), old)

        cache.append(k[:, 300:], k[:, 300:])
        pid, limit = shard_pid(cache, 2), resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, limit[1]))  # a write fails
        try:
            with pytest.raises(OSError, match=r"File too large: .*snap.snapshot-new/shard-2.npz"):
                cache.snapshot(path)
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, limit)
        assert sorted(os.listdir(tmp_path)) == ["snap"]
        now = cache.attend(q)
        cache.restore(path)
        np.testing.assert_array_equal(cache.attend(q), old)

        cache.append(k[:, 300:], k[:, 300:])
        rename = os.rename
        def failing_rename(a, b):  # noqa: E306 - the swap's second rename fails
            if str(a).endswith(".snapshot-new"):
                raise PermissionError(13, "Permission denied", a)
            rename(a, b)
        monkeypatch.setattr(os, "rename", failing_rename)
        with pytest.raises(PermissionError):
            cache.snapshot(path)
        monkeypatch.undo()
        assert sorted(os.listdir(tmp_path)) == ["snap"]
        np.testing.assert_array_equal(cache.attend(q), now)
        cache.restore(path)
        np.testing.assert_array_equal(cache.attend(q), old)

        # stopped between the renames: path missing, the older one aside
        cache.append(k[:, 300:], k[:, 300:])
        cache.snapshot(tmp_path / "other")
        os.rename(path, str(path) + ".snapshot-old")
        os.rename(tmp_path / "other", str(path) + ".snapshot-new")
        cache.restore(path)
        np.testing.assert_array_equal(cache.attend(q), old)
        cache.append(k[:, 300:], k[:, 300:])
        cache.snapshot(path)  # finishes the stopped one first
        assert sorted(os.listdir(tmp_path)) == ["snap"]
        cache.restore(path)
        np.testing.assert_array_equal(cache.attend(q), now)

        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep")
        with pytest.raises(FileExistsError, match="holds files other than a snapshot's "
                                                  r"\(notes.txt\)"):
            cache.snapshot(tmp_path / "mine")
        os.rename(tmp_path / "mine", str(path) + ".snapshot-new")  # never removed either
        with pytest.raises(FileExistsError, match=r"snap.snapshot-new holds files other"):
            cache.snapshot(path)
        assert os.listdir(str(path) + ".snapshot-new") == ["notes.txt"]


def test_a_hung_shard_times_out(tmp_path):
    """A stopped shard process (SIGSTOP) makes attend, append and snapshot
    raise ShardTimeoutError within the timeout, naming it (not the shard
    whose merge waits for it), and ends it; restore brings the cache back."""
    rng = np.random.default_rng(13)
    k = rng.standard_normal((1, 120, 4)).astype(np.float32)
    q = rng.standard_normal((2, 1, 4)).astype(np.float32)
    stopped = []

    def stop(cache, shard):
        stopped.append(shard_pid(cache, shard))
        os.kill(stopped[-1], signal.SIGSTOP)
        # without a timeout the call would wait for ever: let it end
        threading.Timer(20, resume, [stopped[-1]]).start()

    with ShardedKVCache(3, 1, 4, capacity_per_shard=64, chunk_size=8, timeout=4,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k[:, :100], k[:, :100])
        want = cache.attend(q)
        cache.snapshot(tmp_path / "snap")
        calls = [("attend", lambda: cache.attend(q), 1),
                 ("append", lambda: cache.append(k[:, 100:], k[:, 100:]), 2),
                 ("snapshot", lambda: cache.snapshot(tmp_path / "other"), 0)]
        try:
            for name, call, shard in calls:
                stop(cache, shard)
                start = time.perf_counter()
                with pytest.raises(ShardTimeoutError, match=f"shard {shard} of 3 lost .no "
                                                            f"answer to {name} within 4 s"):
                    call()
                assert time.perf_counter() - start < 12
                assert cache.shard_lengths == [36, 32, 32]
                with pytest.raises(ShardLostError):  # and on, as for a dead shard
                    cache.attend(q)
                # Ray ends a stopped process only after a grace period of
                # seconds; resumed, it ends at once, and its CPUs are free
                resume(stopped[-1])
                cache.restore(tmp_path / "snap")
                np.testing.assert_array_equal(cache.attend(q), want)
        finally:
            for pid in stopped:
                resume(pid)
    assert issubclass(ShardTimeoutError, TimeoutError)


def resume(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("kind", ["causal", "lower_right", "offset", "window+alibi", "sinks",
                                  "full"])
def test_sharded_attention_equals_one_call(shards, kind):
    rng = np.random.default_rng(shards * 10 + len(kind))
    Hkv, Hq, L, S, E, Ev = 2, 4, 150, 230, 16, 8
    q = rng.standard_normal((2, Hq, L, E)).astype(np.float32)
    k = rng.standard_normal((2, Hkv, S, E)).astype(np.float32)
    v = rng.standard_normal((2, Hkv, S, Ev)).astype(np.float32)
    opts = {"causal": dict(is_causal=True), "full": {},
            "lower_right": dict(is_causal=True, causal_alignment="lower_right"),
            "offset": dict(is_causal=True, causal_alignment=40, window_size=(60, 10)),
            "window+alibi": dict(is_causal=True, window_size=(20, 0),
                                 alibi_slopes=rng.random((2, Hq)) * 0.2, softcap=10.0),
            "sinks": dict(sinks=rng.standard_normal(Hq), scale=0.2)}[kind]
    out, lse = sharded_attention(q, k, v, shards, enable_gqa=True, return_lse=True,
                                 num_cpus_per_shard=CPUS, **opts)
    want, want_lse = fastattn.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                           return_lse=True, **opts)
    close_to_one_process(out, want, v, np.float32)
    lse_close(lse, want_lse)


def test_sharded_attention_errors():
    q = np.ones((2, 5, 4), np.float32)
    with pytest.raises(ValueError, match=r"value must have as many rows as key \(S = 7\), got 3"):
        sharded_attention(q, np.ones((2, 7, 4), np.float32), np.ones((2, 3, 4), np.float32), 2)
    with pytest.raises(TypeError, match="query must be a numpy.ndarray, got list"):
        sharded_attention(q.tolist(), q, q, 2)
    with pytest.raises(ValueError, match="key must have at least 2 dimensions"):
        sharded_attention(q, q[0, 0], q, 2)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        sharded_attention(q, q, q, 2, return_lse=1)
    with pytest.raises(ValueError, match="no node of the Ray cluster has that many CPUs"):
        sharded_attention(q, q, q, 2, num_cpus_per_shard=3)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        sharded_attention(q, q, q, 2, timeout=0)
    with ShardedKVCache(2, 1, 4, capacity_per_shard=8):  # holds both CPUs
        with pytest.raises(TimeoutError, match="2 of 2 tasks not done within 2 s"):
            sharded_attention(q, q, q, 2, timeout=2)
    assert all_cpus_free()


def test_sharded_attention_dtypes_and_edges():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(9)
    for dtype in (np.float64, np.float16, ml_dtypes.bfloat16):
        q, k, v = (rng.standard_normal((3, n, 8)).astype(dtype) for n in (50, 70, 70))
        out = sharded_attention(q, k, v, 3, is_causal=True, num_cpus_per_shard=CPUS)
        want = ref.scaled_dot_product_attention(*f64(q, k, v), is_causal=True)
        assert_close(out, want, dtype, 8 + 70)
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)
    out, lse = sharded_attention(q, q[:, :0], q[:, :0], 2, return_lse=True,
                                 num_cpus_per_shard=CPUS)  # no keys: zeros, lse -inf
    assert not out.any() and np.isneginf(lse).all()
    out = sharded_attention(q, q, q, 5, num_cpus_per_shard=CPUS)  # more shards than rows
    np.testing.assert_allclose(out, fastattn.scaled_dot_product_attention(q, q, q), atol=1e-6)
    assert sharded_attention(q[:, :0], q, q, 2, num_cpus_per_shard=CPUS).shape == (1, 0, 4)
    with pytest.raises(ValueError, match="num_shards"):
        sharded_attention(q, q, q, 0)
    with pytest.raises(ValueError, match="key's last axis"):
        sharded_attention(q, q[..., :3], q, 2)


def test_import_fastattn_does_not_import_ray(tmp_path):
    code = "import sys, fastattn; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)  # the installed one


def run_script(args, cwd):
    """A script in its own process (it starts its own Ray cluster)."""
    done = subprocess.run([sys.executable] + args, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_example_splits_each_token(tmp_path):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "sharded_decode.py")
    out = run_script([example, "--context", "5000", "--tokens", "3"], tmp_path)
    assert "5000 positions in 2 shards: [4096, 904]" in out  # chunks of 4096, round-robin
    assert "median of tokens 1-2:" in out and "= kernels" in out
    diffs = [float(line.split()[-1]) for line in out.splitlines()[2:5]]
    assert max(diffs) < 1e-6  # float32 outputs of values ~N(0, 1): the merge's rounding


def test_bench_sharded_reports_the_model(tmp_path):
    import json
    out = run_script(["-m", "fastattn", "bench", "--sharded", "--context", "3000", "--repeat",
                      "2", "--no-progress", "--json", "r.json"], tmp_path)
    assert "the cost model:" in out and "arithmetic, per shard" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["context"] == 3000 and len(r["steps"]) == 2
    assert r["model"]["bytes_per_token"] == 3000 * 8 * 256 * 2
    assert r["max_abs_diff_vs_one_process"] < 1e-6
    assert set(r["median_s"]) == {"total", "compute", "merge", "transfer", "one_process"}


def test_a_cache_outliving_ray_says_so(tmp_path):
    cache = ShardedKVCache(2, 1, 4, capacity_per_shard=8, num_cpus_per_shard=CPUS)
    ray.shutdown()
    try:
        with pytest.raises(RuntimeError, match="Ray was shut down"):
            cache.attend(np.ones((1, 1, 4), np.float32))
        cache.close()
    finally:
        start_ray(tmp_path)  # for the tests after this one


def test_snapshots_while_another_thread_appends(tmp_path):
    """A cache's calls hold its lock: a snapshot taken while another thread
    appends records the lengths its files hold, and every one restores."""
    rng = np.random.default_rng(12)
    k = rng.standard_normal((1, 400, 4)).astype(np.float32)
    q = rng.standard_normal((1, 1, 4)).astype(np.float32)
    with ShardedKVCache(2, 1, 4, capacity_per_shard=256, chunk_size=4,
                        num_cpus_per_shard=CPUS) as cache:
        def appends():
            for i in range(100):
                cache.append(k[:, 4 * i:4 * i + 4], k[:, 4 * i:4 * i + 4])
        writer = threading.Thread(target=appends)
        writer.start()
        for i in range(10):
            cache.snapshot(tmp_path / f"s{i}")
        writer.join()
        for i in range(10):
            cache.restore(tmp_path / f"s{i}")
            n = cache.length
            want = fastattn.reference.scaled_dot_product_attention(
                *(x.astype(np.float64) for x in (q, k[:, :n], k[:, :n])), is_causal=False)
            np.testing.assert_allclose(cache.attend(q, is_causal=False), want, atol=1e-5)


def test_a_snapshot_through_a_symbolic_link(tmp_path):
    """A link stands for its target: snapshots through it, again and again,
    replace the target and leave the link a link."""
    k = np.random.default_rng(13).standard_normal((1, 12, 4)).astype(np.float32)
    with ShardedKVCache(2, 1, 4, capacity_per_shard=16, chunk_size=4,
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k[:, :6], k[:, :6])
        cache.snapshot(tmp_path / "real")
        (tmp_path / "link").symlink_to(tmp_path / "real")
        for n in (8, 12):
            cache.append(k[:, n - 2:n], k[:, n - 2:n])
            cache.snapshot(tmp_path / "link")
            assert (tmp_path / "link").is_symlink()
        cache.append(k[:, :1], k[:, :1])
        cache.restore(tmp_path / "link")
        assert cache.length == 10
        assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


@pytest.mark.parametrize("timeout", [0, -1, 2.0**31 + 1, 1e300])
def test_timeouts_out_of_range(timeout):
    with pytest.raises(ValueError, match=r"timeout must be > 0 and at most 2\*\*31 seconds"):
        ShardedKVCache(1, 1, 4, capacity_per_shard=4, timeout=timeout)


def test_the_int8_mode_reaches_every_shard():
    """precision="int8" over int8 shards: within test_int8_mode's bounds of
    one cache's twin (each shard's groups of key positions are the same as
    one cache's here: chunks of 64 positions)."""
    from test_int8_mode import check

    rng = np.random.default_rng(11)
    k = rng.standard_normal((2, 300, 64)).astype(np.float32)
    v = rng.standard_normal((2, 300, 64)).astype(np.float32)
    q = rng.standard_normal((4, 1, 64)).astype(np.float32)
    one = fastattn.KVCache(1, 2, 300, 64, storage="int8")
    one.append(k[None], v[None])
    with ShardedKVCache(2, 2, 64, capacity_per_shard=256, chunk_size=64, storage="int8",
                        num_cpus_per_shard=CPUS) as cache:
        cache.append(k, v)
        out = cache.attend(q, precision="int8")
        check(out[None], one, q[None], "int8", v[None])
        assert not np.array_equal(out, cache.attend(q))  # the mode was taken
        with pytest.raises(ValueError, match="precision"):
            cache.attend(q, precision="int4")
