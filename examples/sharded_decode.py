"""Decoding over a context split across processes: fastattn.distributed on Ray.

    python examples/sharded_decode.py                      # a local Ray cluster
    python examples/sharded_decode.py --shards 4 --context 262144
    python examples/sharded_decode.py --address auto       # an existing cluster

A Llama-shaped attention layer (32 query heads over 8 key/value heads of
128) holds --context positions in a ShardedKVCache of --shards Ray actors
(float16 storage), then decodes --tokens tokens: each step appends the new
token's key and value (to the shard its position is dealt to) and attends
its query over all the shards, which merge their parts in a tree.  Every
step is checked against one process's KVCache holding the same positions,
and the time of each is split into the slowest shard's kernels, the
merges, and the rest (Ray's messages and object store, "transfer").  See
README, "Across machines", for the cost model these figures test.
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import fastattn
from fastattn._extras import need

need("ray", "examples/sharded_decode.py")  # a one-line hint, not a traceback, without Ray
import ray  # noqa: E402
from fastattn.distributed import ShardedKVCache  # noqa: E402

HQ, HKV, E = 32, 8, 128


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--context", type=int, default=1 << 17, help="positions held (default 131072)")
    p.add_argument("--tokens", type=int, default=8, help="decoding steps timed (default 8)")
    p.add_argument("--address", default=None, help="a Ray cluster to join (default: start one)")
    args = p.parse_args()

    here = os.getcwd()
    os.chdir(tempfile.gettempdir())  # Ray's workers start in this folder: not a source tree
    ray.init(address=args.address, num_cpus=None if args.address else max(args.shards, 1),
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    os.chdir(here)
    rng = np.random.default_rng(0)
    total = args.context + args.tokens
    one = fastattn.KVCache(1, HKV, total, E, storage="float16")
    with ShardedKVCache(args.shards, HKV, E, capacity_per_shard=-(-total // args.shards) + 4096,
                        storage="float16", chunk_size=4096) as cache:
        piece = 1 << 14
        for n in range(0, args.context, piece):
            m = min(piece, args.context - n)
            key, value = (rng.standard_normal((HKV, m, E)).astype(np.float32) for _ in range(2))
            cache.append(key, value)
            one.append(key[None], value[None])
        print(f"{cache.length} positions in {args.shards} shards: {cache.shard_lengths}")
        print(f"{'token':>5} {'total ms':>9} {'kernels':>8} {'merges':>7} {'transfer':>9} "
              f"{'one process':>12} {'max |diff|':>11}")
        rows = []
        for t in range(args.tokens):
            key, value, query = (rng.standard_normal(shape).astype(np.float32)
                                 for shape in [(HKV, 1, E), (HKV, 1, E), (HQ, 1, E)])
            cache.append(key, value)
            one.append(key[None], value[None])
            out = cache.attend(query)
            split = cache.last_timing
            start = time.perf_counter()
            want = one.attend(query[None], num_threads=args.shards)[0]
            alone = time.perf_counter() - start
            diff = float(np.abs(out - want).max())
            print(f"{t:5d} {split['total'] * 1e3:9.1f} {split['compute'] * 1e3:8.1f} "
                  f"{split['merge'] * 1e3:7.2f} {split['transfer'] * 1e3:9.1f} "
                  f"{alone * 1e3:12.1f} {diff:11.1e}")
            rows.append((split, alone))
    ray.shutdown()
    later = rows[1:] or rows  # the first step starts the shards' threads
    median = {k: statistics.median(s[k] for s, _ in later) for k in later[0][0]}
    print(f"median of tokens 1-{len(rows) - 1}: {median['total'] * 1e3:.1f} ms = kernels "
          f"{median['compute'] * 1e3:.1f} + merges {median['merge'] * 1e3:.2f} + transfer "
          f"{median['transfer'] * 1e3:.1f}; one process "
          f"{statistics.median(a for _, a in later) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
