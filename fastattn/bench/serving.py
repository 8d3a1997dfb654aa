"""`fastattn bench --serving`: one serving step of a ragged batch over a paged
cache against the ways to do it without one, measured side by side in one
process (alternating rounds, medians).

Steps of a Llama-shaped attention layer (32 query heads over 8 key/value
heads of 128, float32): "decode-64", one new token for each of 64 sequences
whose lengths are drawn from 64 to 8192 (fixed seed); "mixed", the same 64
sequences where 4 bring a prefill chunk of 512 tokens and 60 a decoding
token; "tree-8", speculative decoding's verify step: each of the 64 brings a
random tree of 8 draft tokens under its tree mask; and "shared-16", 16
sequences forked from a prompt of 8192 tokens (parallel sampling), 64 own
tokens each and a decoding token, the prompt's blocks shared in the pool
(and "shared-16-mha", the same with 8 query heads over the 8).  Then the
prefix-cache scenario (prefix_cache).  The rows:

  paged           fastattn.paged_attention, blocks of 128 in shuffled order
  paged-16        the same with blocks of 16 (each block's rows of a head
                  are 8 KB: pieces that small in a random order read at
                  about 60 % of a sequential stream's speed on Zen 4)
  contiguous      the same keys and values read in place, each sequence's
                  contiguous: varlen_attention (lower-right causal)
  dense-equal     decode only: scaled_dot_product_attention on a dense batch
                  of 64 sequences of equal length, the same number of keys:
                  the time of reading these keys and values contiguously
  padded          (a) one dense padded cache: every sequence padded (left)
                  to the longest, queries too, a key padding mask
  per-sequence    (b) one scaled_dot_product_attention call per sequence
  torch-padded    (c) PyTorch's SDPA on the padded batch with a bool mask
  plain           tree-8 only: the paged call of the same query tokens with
                  no tree (causal), what the tree mask is measured against
  unshared        shared steps only: the paged call over a pool where each
                  sequence holds a copy of the prompt's blocks, whose reads
                  no sequence shares
  cascade         shared steps only: paged with cascade=True (opt-in: the
                  prompt once for all the queries as one matrix product,
                  merged by log-sum-exp; not each sequence's exact bits)

"MB read" is the bytes of keys and values the paged calls' kernels stream,
as the scheduler counts them (a shared block once for the sequences that
read it together); GF/s counts 4 E flops per query head and visible key.

Every row's output but plain's is checked against the paged call's before
it is timed; the padded and per-sequence rows of tree-8 take each tree as a
mask of all the keys.
"""
import contextlib
import statistics
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Dict, List, Optional

import numpy as np

import fastattn
from fastattn import _dispatch

HQ, HKV, E = 32, 8, 128
BLOCK = 128


@dataclass
class Step:
    name: str
    q_lens: np.ndarray    # new tokens per sequence
    k_lens: np.ndarray    # keys held per sequence, the new ones included
    trees: Optional[List[np.ndarray]] = None  # each sequence's (L, L) tree mask
    shared: int = 0       # the first positions every sequence holds in the same blocks
    heads: int = HQ       # query heads

    @property
    def kv_bytes(self):
        """Bytes of keys and values one step reads (float32)."""
        return int(self.k_lens.sum()) * HKV * E * 2 * 4

    @property
    def flops(self):
        """4 E flops per query head and visible key (scores and values): query
        i of L sees S - L + i + 1 keys, or its ancestors in a tree."""
        pairs = 0
        for b, (L, S) in enumerate(zip(self.q_lens, self.k_lens)):
            seen = (S - L) * L + (L * (L + 1) // 2 if self.trees is None
                                  else int(self.trees[b].sum()))
            pairs += int(seen)
        return 4 * E * self.heads * pairs


def steps(seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(64, 8193, 64)
    decode = Step("decode-64", np.ones(64, np.int64), lens)
    q_lens = np.ones(64, np.int64)
    q_lens[rng.choice(64, 4, replace=False)] = 512
    trees = [random_tree(rng, 8) for _ in range(64)]
    forked = np.full(16, 8192 + 64 + 1, np.int64)  # the prompt, 64 own tokens, the new one
    return [decode, Step("mixed", q_lens, np.maximum(lens, q_lens)),
            Step("tree-8", np.full(64, 8, np.int64), lens, trees),
            Step("shared-16", np.ones(16, np.int64), forked, shared=8192),
            Step("shared-16-mha", np.ones(16, np.int64), forked, shared=8192, heads=HKV)]


def random_tree(rng, n):
    """The (n, n) mask of a random tree of n draft tokens in topological
    order: token i sees itself and its ancestors."""
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        mask[i] |= mask[int(rng.integers(0, i))]
    return mask


class Batch:
    """A step's inputs in every layout the rows read: the packed queries,
    each sequence's keys and values, the pool and its block table."""

    def __init__(self, step, seed=0):
        rng = np.random.default_rng(seed + 1)
        self.step = step
        self.cu_q = np.concatenate([[0], np.cumsum(step.q_lens)])
        self.cu_k = np.concatenate([[0], np.cumsum(step.k_lens)])
        T = int(self.cu_k[-1])
        self.query = rng.standard_normal((int(self.cu_q[-1]), step.heads, E), dtype=np.float32)
        # (T, HKV, E) views of head-major arrays: every head's rows of a
        # sequence contiguous, as in a dense cache
        self.key = rng.standard_normal((HKV, T, E), dtype=np.float32).transpose(1, 0, 2)
        self.value = rng.standard_normal((HKV, T, E), dtype=np.float32).transpose(1, 0, 2)
        for start in self.cu_k[1:-1] if step.shared else ():  # the prompt's rows, copied
            self.key[start:start + step.shared] = self.key[:step.shared]
            self.value[start:start + step.shared] = self.value[:step.shared]
        self.pools = {bs: self._pool(bs, rng, step.shared) for bs in (BLOCK, 16)}
        if step.shared:
            self.pools["unshared"] = self._pool(BLOCK, rng, 0)

    def _pool(self, block_size, rng, shared):
        """The pool of blocks of block_size positions in shuffled order and
        the block table; the first shared // block_size blocks of every
        sequence are the same ones."""
        common = shared // block_size
        need = -(-self.step.k_lens // block_size)
        n = int(need.sum()) - common * (len(need) - 1)
        key = np.empty((n, HKV, block_size, E), np.float32)
        value = np.empty_like(key)
        order = rng.permutation(n)
        table = np.zeros((len(need), int(need.max())), np.int32)
        at = common
        for b, (c, S) in enumerate(zip(need, self.step.k_lens)):
            blocks = np.concatenate([order[:common], order[at:at + c - common]])
            at += c - common
            table[b, :c] = blocks
            j = np.arange(S)
            rows = slice(self.cu_k[b], self.cu_k[b + 1])
            key[blocks[j // block_size], :, j % block_size] = self.key[rows]
            value[blocks[j // block_size], :, j % block_size] = self.value[rows]
        return key, value, table

    def seq(self, b):
        """Sequence b's query (HQ, L, E), key and value (HKV, S, E): views
        whose rows are contiguous, as one dense cache per sequence holds them."""
        q = self.query[self.cu_q[b]:self.cu_q[b + 1]].transpose(1, 0, 2)
        k = self.key[self.cu_k[b]:self.cu_k[b + 1]].transpose(1, 0, 2)
        v = self.value[self.cu_k[b]:self.cu_k[b + 1]].transpose(1, 0, 2)
        return q, k, v

    def padded(self):
        """(B, HQ, Lmax, E) queries and (B, HKV, Smax, E) keys and values, each
        sequence at the end (left padding), and the (B, 1, 1, Smax) key mask
        (True = a real key)."""
        B, Lm, Sm = len(self.step.q_lens), int(self.step.q_lens.max()), int(self.step.k_lens.max())
        q = np.zeros((B, self.step.heads, Lm, E), np.float32)
        k = np.zeros((B, HKV, Sm, E), np.float32)
        v = np.zeros((B, HKV, Sm, E), np.float32)
        real = np.zeros((B, 1, 1, Sm), bool)
        for b in range(B):
            qb, kb, vb = self.seq(b)
            q[b, :, Lm - qb.shape[1]:], k[b, :, Sm - kb.shape[1]:] = qb, kb
            v[b, :, Sm - vb.shape[1]:] = vb
            real[b, ..., Sm - kb.shape[1]:] = True
        return q, k, v, real

    def from_padded(self, out):
        """The packed (total_q, HQ, E) rows of a padded (B, HQ, Lmax, E) output."""
        Lm = out.shape[2]
        return np.concatenate([out[b, :, Lm - L:].transpose(1, 0, 2)
                               for b, L in enumerate(self.step.q_lens)])


def rows(batch, threads) -> Dict[str, Callable[[], np.ndarray]]:
    """Each row's call, returning the packed (total_q, HQ, E) output."""
    s = batch.step
    calls = {}
    tree = None if s.trees is None else np.concatenate([t.ravel() for t in s.trees])
    pools = [("paged", BLOCK), ("paged-16", 16)] + ([("unshared", "unshared")] if s.shared else [])
    for name, bs in pools:
        key, value, table = batch.pools[bs]
        calls[name] = (lambda key=key, value=value, table=table: fastattn.paged_attention(
            batch.query, key, value, table, s.k_lens, batch.cu_q, num_threads=threads,
            tree_mask=tree))
    if s.shared:  # the opt-in cascade: the prompt once for all the queries, then merged
        key, value, table = batch.pools[BLOCK]
        calls["cascade"] = lambda: fastattn.paged_attention(
            batch.query, key, value, table, s.k_lens, batch.cu_q, num_threads=threads,
            cascade=True)
    if tree is not None:
        key, value, table = batch.pools[BLOCK]
        calls["plain"] = lambda: fastattn.paged_attention(
            batch.query, key, value, table, s.k_lens, batch.cu_q, num_threads=threads)
        return _tree_rows(batch, threads, calls)
    calls["contiguous"] = lambda: fastattn.varlen_attention(
        batch.query, batch.key, batch.value, batch.cu_q, batch.cu_k, is_causal=True,
        causal_alignment="lower_right", num_threads=threads)
    if (s.q_lens == 1).all():  # the same number of keys in 64 equal sequences, dense
        B, T = len(s.k_lens), int(batch.cu_k[-1])
        S = T // B
        k = batch.key[:B * S].transpose(1, 0, 2).reshape(HKV, B, S, E).transpose(1, 0, 2, 3)
        v = batch.value[:B * S].transpose(1, 0, 2).reshape(HKV, B, S, E).transpose(1, 0, 2, 3)
        q = batch.query.reshape(B, 1, s.heads, E).transpose(0, 2, 1, 3)
        calls["dense-equal"] = lambda: fastattn.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, num_threads=threads).transpose(0, 2, 1, 3).reshape(
                B, s.heads, E)
    pq, pk, pv, real = batch.padded()
    calls["padded"] = lambda: batch.from_padded(fastattn.scaled_dot_product_attention(
        pq, pk, pv, attn_mask=real, is_causal=True, causal_alignment="lower_right",
        enable_gqa=True, num_threads=threads))
    seqs = [batch.seq(b) for b in range(len(s.q_lens))]
    calls["per-sequence"] = lambda: np.concatenate([fastattn.scaled_dot_product_attention(
        q, k, v, is_causal=True, causal_alignment="lower_right", enable_gqa=True,
        num_threads=threads).transpose(1, 0, 2) for q, k, v in seqs])
    with contextlib.suppress(ImportError):
        calls["torch-padded"] = _torch_padded(batch, pq, pk, pv, real, threads)
    return calls


def _tree_rows(batch, threads, calls):
    """tree-8's rows besides the paged ones: each tree as a mask of all the
    keys, in the padded batch and per sequence."""
    s = batch.step
    pq, pk, pv, real = batch.padded()
    Lm, Sm = pq.shape[2], pk.shape[2]
    mask = np.repeat(real, Lm, axis=2)
    for b, t in enumerate(s.trees):  # (left padded: every tree ends at Sm)
        mask[b, 0, Lm - len(t):, Sm - len(t):] &= t
    calls["padded"] = lambda: batch.from_padded(fastattn.scaled_dot_product_attention(
        pq, pk, pv, attn_mask=mask, is_causal=True, causal_alignment="lower_right",
        enable_gqa=True, num_threads=threads))
    seqs = [batch.seq(b) for b in range(len(s.q_lens))]
    full = [mask[b, :, Lm - L:, Sm - S:] for b, (L, S) in enumerate(zip(s.q_lens, s.k_lens))]
    calls["per-sequence"] = lambda: np.concatenate([fastattn.scaled_dot_product_attention(
        q, k, v, attn_mask=m, is_causal=True, causal_alignment="lower_right", enable_gqa=True,
        num_threads=threads).transpose(1, 0, 2) for (q, k, v), m in zip(seqs, full)])
    with contextlib.suppress(ImportError):
        calls["torch-padded"] = _torch_padded(batch, pq, pk, pv, mask, threads)
    return calls


def _torch_padded(batch, pq, pk, pv, real, threads):
    import torch
    import torch.nn.functional as F

    Lm, Sm = pq.shape[2], pk.shape[2]
    causal = np.arange(Sm)[None, :] <= np.arange(Lm)[:, None] + Sm - Lm
    mask = torch.from_numpy(real & causal[None, None])
    tq, tk, tv = (torch.from_numpy(a) for a in (pq, pk, pv))

    def call():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
        finally:
            torch.set_num_threads(before)
        return batch.from_padded(out.numpy())
    return call


def measure(step, threads, *, rounds=5, seed=0, only: Optional[List[str]] = None,
            progress=None):
    """{row: {"median", "times", "max_abs_diff"}} for one step and thread
    count: the rows timed in turn, round after round (slow ones, the padded
    rows of the mixed step, in fewer rounds), after one untimed call whose
    output is compared with the paged call's."""
    batch = Batch(step, seed)
    calls = rows(batch, threads)
    if only:
        calls = {n: c for n, c in calls.items() if n in only or n == "paged"}
    want = calls["paged"]()
    result = {}
    for name, call in calls.items():
        start = perf_counter()
        with _dispatch.reads() as read:
            out = call()
        first = perf_counter() - start
        same = out.size and name != "plain"  # (plain: another step's output)
        result[name] = {"max_abs_diff": float(np.abs(out - want).max()) if same else 0.0,
                        "times": [], "rounds": rounds if first < 2.0 else 1}
        if name in ("paged", "paged-16", "unshared", "cascade", "plain"):
            result[name]["read_bytes"] = sum(read)
        if progress:
            progress(name)
    for r in range(rounds):
        for name, call in calls.items():
            if r < result[name]["rounds"]:
                start = perf_counter()
                call()
                result[name]["times"].append(perf_counter() - start)
    for name, row in result.items():
        row["median"] = statistics.median(row["times"])
        del row["rounds"]
    memory = {
        "paged": (int(-(-step.k_lens // BLOCK).sum()) - step.shared // BLOCK * (len(step.k_lens) - 1))
        * BLOCK * HKV * E * 2 * 4,
        "padded": len(step.k_lens) * int(step.k_lens.max()) * HKV * E * 2 * 4,
        "exact": step.kv_bytes}
    return {"step": step.name, "threads": threads, "kv_bytes": step.kv_bytes, "rows": result,
            "memory": memory, "tokens": int(step.k_lens.sum()),
            "queries": int(step.q_lens.sum()), "flops": step.flops, "heads": step.heads,
            "shared": step.shared}


PROMPTS, PROMPT_LEN, REQUESTS, LIVE = 4, 2048, 64, 8
VOCAB = 1000


def prefix_cache(threads, seed=0):
    """The prefix-cache scenario: REQUESTS requests arrive one after another,
    each a system prompt drawn from PROMPTS of PROMPT_LEN tokens plus 128 to
    512 tokens of its own, into a PagedKVCache(enable_prefix_caching=True)
    (blocks of BLOCK) that holds the LIVE latest requests and, in its other
    blocks, what freed requests left named (evicted least recently freed
    first).  Each request matches its cached prefix, appends the rest and
    computes the prefill attention of its uncached tokens; the same request
    without the cache computes all of its tokens.  Keys and values depend
    on a token's id and position alone, as a model's would.  Returns the
    hit rate (cached prompt tokens / prompt tokens) and the attention-only
    prefill times per request, ms."""
    rng = np.random.default_rng(seed + 7)
    prompts = rng.integers(0, VOCAB, (PROMPTS, PROMPT_LEN))
    kemb = rng.standard_normal((VOCAB, HKV, E), dtype=np.float32)
    vemb = rng.standard_normal((VOCAB, HKV, E), dtype=np.float32)
    wave = np.cos(np.arange(PROMPT_LEN + 512)[:, None, None] * 1e-3 *
                  np.arange(1, E + 1)).astype(np.float32)
    largest = -(-(PROMPT_LEN + 512) // BLOCK)
    blocks = largest * (LIVE + PROMPTS + 2)  # the live requests, the prompts kept named
    cache = fastattn.PagedKVCache(blocks, BLOCK, HKV, E, enable_prefix_caching=True)
    plain = fastattn.PagedKVCache(largest + 1, BLOCK, HKV, E)
    live, cached_ms, full_ms, hits, prompt_tokens = [], [], [], 0, 0
    for _ in range(REQUESTS):
        tokens = np.concatenate([prompts[rng.integers(PROMPTS)],
                                 rng.integers(0, VOCAB, int(rng.integers(128, 513)))])
        n = len(tokens)
        key, value = kemb[tokens] * wave[:n], vemb[tokens] * wave[:n]
        query = rng.standard_normal((n, HQ, E), dtype=np.float32)
        seq = cache.add_sequence()
        m = cache.match_prefix(seq, tokens)
        hits, prompt_tokens = hits + m, prompt_tokens + n
        cache.append([seq], key[m:], value[m:], np.array([0, n - m]), token_ids=tokens[m:])
        start = perf_counter()
        out = cache.attend([seq], query[m:], np.array([0, n - m]), num_threads=threads)
        cached_ms.append((perf_counter() - start) * 1e3)
        other = plain.add_sequence()
        plain.append([other], key, value, np.array([0, n]))
        start = perf_counter()
        whole = plain.attend([other], query, np.array([0, n]), num_threads=threads)
        full_ms.append((perf_counter() - start) * 1e3)
        plain.free(other)
        if not np.array_equal(out, whole[m:]):
            raise AssertionError("a prefix-cache hit changed the bits of its request")
        live.append(seq)
        if len(live) > LIVE:
            cache.free(live.pop(0))
    return {"threads": threads, "requests": REQUESTS, "hit_rate": hits / prompt_tokens,
            "cached_ms": cached_ms, "full_ms": full_ms,
            "cached_median": statistics.median(cached_ms),
            "full_median": statistics.median(full_ms),
            "cached_total": sum(cached_ms), "full_total": sum(full_ms)}


def run(threads=(1, 2), rounds=5, seed=0, progress=True):
    from tqdm import tqdm

    cases = [(s, n) for s in steps(seed) for n in threads]
    out, prefix = [], []
    with tqdm(total=len(cases) + len(threads), desc="fastattn bench --serving", unit="case",
              disable=not progress, dynamic_ncols=True) as bar:
        for step, n in cases:
            bar.set_postfix_str(f"{step.name}, {n} thread(s)")
            out.append(measure(step, n, rounds=rounds, seed=seed))
            bar.update()
        for n in threads:
            bar.set_postfix_str(f"prefix cache, {n} thread(s)")
            prefix.append(prefix_cache(n, seed))
            bar.update()
    return {"machine": _machine(), "cases": out, "prefix_cache": prefix}


def _machine():
    from . import measure as m
    return m.machine_info()


def format_table(result):
    lines = []
    for case in result["cases"]:
        paged = case["rows"]["paged"]["median"]
        mem = case["memory"]
        shared = f", the first {case['shared']} shared" if case.get("shared") else ""
        lines.append(f"{case['step']}: {len(case['rows'])} rows, {case['queries']} queries "
                     f"({case.get('heads', HQ)} heads) over {case['tokens']} keys{shared} "
                     f"({case['kv_bytes'] / 2**30:.2f} GiB of keys and values), "
                     f"{case['threads']} thread(s)")
        lines.append(f"  {'row':14s} {'ms':>9s} {'x paged':>8s} {'GB/s':>7s} {'GF/s':>7s} "
                     f"{'MB read':>8s} {'max |diff|':>11s}")
        for name, row in case["rows"].items():
            t = row["median"]
            read = f"{row['read_bytes'] / 1e6:8.1f}" if "read_bytes" in row else f"{'':8s}"
            gf = f"{case['flops'] / t / 1e9:7.1f}" if "flops" in case else f"{'':7s}"
            lines.append(f"  {name:14s} {t * 1e3:9.2f} {t / paged:8.2f} "
                         f"{case['kv_bytes'] / t / 1e9:7.1f} {gf} {read} "
                         f"{row['max_abs_diff']:11.1e}")
        lines.append(f"  memory: paged {mem['paged'] / 2**30:.2f} GiB (blocks in use), padded "
                     f"{mem['padded'] / 2**30:.2f} GiB, the keys themselves "
                     f"{mem['exact'] / 2**30:.2f} GiB")
        lines.append("")
    for p in result.get("prefix_cache", []):
        lines.append(f"prefix cache: {p['requests']} requests over {PROMPTS} system prompts of "
                     f"{PROMPT_LEN} tokens, {p['threads']} thread(s): hit rate "
                     f"{p['hit_rate']:.1%} of the prompt tokens; prefill attention per request, "
                     f"median {p['cached_median']:.1f} ms (cached prefix) against "
                     f"{p['full_median']:.1f} ms (every token), in all {p['cached_total']:.0f} "
                     f"against {p['full_total']:.0f} ms")
    return "\n".join(lines)
