"""`fastattn bench --sharded`: decoding over a key/value cache sharded on
Ray, per token, against the arithmetic of the cost model (README, "Across
machines").

A Llama-shaped layer (32 query heads over 8 key/value heads of 128) with a
context of 2**20 positions stored as float16 (4 GiB of keys and values),
dealt to 2 shards (Ray actors of one CPU each, one kernel thread) on this
machine, decodes a few tokens: each step appends one position and attends
one query.  Beside it, one process holding the same cache (a KVCache at
as many threads as shards) is timed on the same steps, and the read
bandwidth of this machine at 1 and at shards threads is measured.

The model: a shard reads its S/N positions' keys and values once per
token and does 2 Hq (E + Ev) flops per position (each key and value row
serves Hq / Hkv query heads), so its kernel time is the larger of those
bytes over the read bandwidth it has and those flops over the FMA peak
(on one machine the shards share the memory bus: all S positions' bytes
over the bandwidth at N threads); the merge and the network then add
about (1 + log2 N) messages of Hq (Ev + 1) float32 (the query out, the
parts back through the tree).  What Ray adds (scheduling, serialisation,
the object store) is the measured "transfer".
"""
import math
import os
import statistics
import tempfile
from time import perf_counter

import numpy as np

import fastattn

from .cpu import machine_label

HQ, HKV, E = 32, 8, 128
PIECE = 1 << 15  # positions per append while filling: 128 MiB of float32 keys and values
NETWORKS = {"10 Gb/s": 10e9 / 8, "100 Gb/s": 100e9 / 8}  # bytes/s
LATENCY = 50e-6  # seconds per message


def model(context, shards, read_gbps_each, read_gbps_all, gflops_each, element_bytes=2):
    """The cost model's per-token seconds: kernel time on separate machines
    and on this one (the larger of reading and computing), and the
    network's share per link speed."""
    kv_bytes = context * HKV * 2 * E * element_bytes
    flops = 2 * context * HQ * 2 * E  # q.k and p.v for every query head
    arithmetic = flops / shards / (gflops_each * 1e9)
    message = HQ * (E + 1) * 4  # a merged part: out and lse, float32
    hops = 1 + math.ceil(math.log2(shards)) if shards > 1 else 0
    return {"bytes_per_token": kv_bytes, "flops_per_token": flops, "message_bytes": message,
            "read_separate_s": kv_bytes / shards / (read_gbps_each * 1e9),
            "read_one_machine_s": kv_bytes / (read_gbps_all * 1e9),
            "arithmetic_s": arithmetic,
            "network_s": {name: hops * (LATENCY + message / rate)
                          for name, rate in NETWORKS.items()}}


def run(context=1 << 20, shards=2, tokens=8, warmup=2, seed=0, progress=True):
    """Fills a ShardedKVCache and a KVCache with context positions and
    times decoding steps on both, alternating; returns a dict for --json."""
    import ray

    from fastattn.distributed import ShardedKVCache

    from .measure import fma_peak, machine_info, read_bandwidth

    rng = np.random.default_rng(seed)
    bw_1 = read_bandwidth(1)["gbps"]
    bw_n = read_bandwidth(shards)["gbps"]
    gflops = fma_peak(1)["gflops"]
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)  # Ray's workers start in the driver's folder: not a source tree
        try:
            ray.init(num_cpus=shards, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        finally:
            os.chdir(here)
    try:
        key = rng.standard_normal((HKV, PIECE, E)).astype(np.float32)
        value = rng.standard_normal((HKV, PIECE, E)).astype(np.float32)
        one = fastattn.KVCache(1, HKV, context + warmup + tokens, E, storage="float16")
        capacity = -(-(context + warmup + tokens) // shards) + 4096
        with ShardedKVCache(shards, HKV, E, capacity_per_shard=capacity, storage="float16",
                            chunk_size=4096, num_cpus_per_shard=1) as cache:
            start = perf_counter()
            for n in range(0, context, PIECE):  # one random piece, repeated: speed only
                m = min(PIECE, context - n)
                cache.append(key[:, :m], value[:, :m])
                one.append(key[None, :, :m], value[None, :, :m])
                if progress:
                    print(f"\rfilling: {n + m} of {context} positions", end="", flush=True)
            fill = perf_counter() - start
            if progress:
                print()
            steps, worst = [], 0.0
            for t in range(warmup + tokens):
                k1, v1 = (rng.standard_normal((HKV, 1, E)).astype(np.float32) for _ in range(2))
                q = rng.standard_normal((HQ, 1, E)).astype(np.float32)
                cache.append(k1, v1)
                one.append(k1[None], v1[None])
                out = cache.attend(q)
                timing = dict(cache.last_timing)
                start = perf_counter()
                want = one.attend(q[None], num_threads=shards)[0]
                timing["one_process"] = perf_counter() - start
                worst = max(worst, float(np.abs(out - want).max()))
                if t >= warmup:
                    steps.append(timing)
    finally:
        ray.shutdown()
    median = {name: statistics.median(s[name] for s in steps) for name in steps[0]}
    return {"machine": machine_info(), "context": context, "shards": shards,
            "query_heads": HQ, "kv_heads": HKV, "head_dim": E, "storage": "float16",
            "tokens": tokens, "fill_s": fill, "read_gbps": {"1": bw_1, str(shards): bw_n},
            "fma_gflops_1": gflops,
            "median_s": median, "steps": steps, "max_abs_diff_vs_one_process": worst,
            "model": model(context, shards, bw_1, bw_n, gflops)}


def format_table(r):
    m, mod = r["median_s"], r["model"]
    ms = 1e3
    lines = [f"decoding over a sharded cache: {r['context']} positions, {r['kv_heads']} key/value "
             f"heads of {r['head_dim']} ({mod['bytes_per_token'] / 2**30:.1f} GiB as "
             f"{r['storage']}), {r['query_heads']} query heads, {r['shards']} shards on this "
             f"machine; medians of {r['tokens']} tokens",
             f"  CPU: {machine_label(r['machine'])}",
             f"  read bandwidth {r['read_gbps']['1']:.1f} GB/s at 1 thread, "
             f"{r['read_gbps'][str(r['shards'])]:.1f} at {r['shards']}; FMA peak "
             f"{r['fma_gflops_1']:.0f} GFLOP/s per core",
             "", f"  {'per token':34s} {'ms':>8s}",
             f"  {'sharded: total':34s} {m['total'] * ms:8.1f}",
             f"  {'  slowest shard kernels':34s} {m['compute'] * ms:8.1f}",
             f"  {'  merges (tree)':34s} {m['merge'] * ms:8.2f}",
             f"  {'  transfer (Ray: messages, store)':34s} {m['transfer'] * ms:8.1f}",
             f"  {'one process, same threads':34s} {m['one_process'] * ms:8.1f}",
             "", "  the cost model:",
             f"  {'reading, shards on this machine':34s} {mod['read_one_machine_s'] * ms:8.1f}"
             "  (all bytes / read GB/s at N threads)",
             f"  {'reading, one machine per shard':34s} {mod['read_separate_s'] * ms:8.1f}"
             "  (S/N positions' bytes / 1-thread GB/s)",
             f"  {'arithmetic, per shard':34s} {mod['arithmetic_s'] * ms:8.1f}"
             f"  ({mod['flops_per_token'] / 1e9:.1f} GFLOP / N / FMA peak)"]
    for name, s in mod["network_s"].items():
        lines.append(f"  {'network at ' + name + ', 50 us':34s} {s * ms:8.2f}"
                     f"  ({mod['message_bytes'] / 1024:.1f} KiB per message)")
    lines.append(f"  max |sharded - one process| = {r['max_abs_diff_vs_one_process']:.2e}")
    return "\n".join(lines)
