"""Random serving workloads on one PagedKVCache: sequences added (their
prompts' cached prefixes matched), forked, appended to, verified with trees
of draft tokens and their paths kept, truncated and freed, in a pool small
enough that named blocks are evicted and appends fail for want of blocks.
After every step the block accounting is checked against a shadow of what
each sequence holds (every held row, bit for bit, and who holds each
block), and every few steps attention, trees included, against the
float64 reference."""
import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

H, HQ, E, BS, BLOCKS = 2, 4, 8, 4, 30
PROMPTS = [list(range(100 + 10 * p, 100 + 10 * p + 9)) for p in range(3)]


def rows(tokens, positions):
    """Keys and values of tokens at positions: a function of both alone, as
    a model's are of the prefix (the same prefix, the same rows)."""
    t = np.asarray(tokens, np.float64)[:, None, None]
    pos = np.asarray(positions, np.float64)[:, None, None]
    grid = np.arange(H * E, dtype=np.float64).reshape(1, H, E)
    k = np.sin(0.37 * t + 0.11 * pos + 0.05 * grid).astype(np.float32)
    v = np.cos(0.23 * t - 0.07 * pos + 0.03 * grid).astype(np.float32)
    return k, v


class Workload:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.cache = fastattn.PagedKVCache(BLOCKS, BS, H, E, enable_prefix_caching=True)
        self.tokens = {}  # sequence -> its token ids, position by position

    # ---- operations: each leaves the shadow equal to the cache ------------
    def add(self, ids=None):
        """A new request: ids, or a prompt drawn from the shared ones."""
        if ids is None:
            base = PROMPTS[self.rng.integers(len(PROMPTS))]
            ids = base[:self.rng.integers(1, len(base) + 1)] + \
                list(self.rng.integers(0, 50, self.rng.integers(0, 6)))
        s = self.cache.add_sequence()
        n = self.cache.match_prefix(s, np.array(ids))
        assert n % BS == 0 and n < len(ids)
        if self._append(s, ids[n:], range(n, len(ids))):
            self.tokens[s] = list(ids)
        else:
            self.cache.free(s)

    def fork(self, s):
        self.tokens[self.cache.fork(s)] = list(self.tokens[s])

    def decode(self, s):
        new = list(self.rng.integers(0, 50, self.rng.integers(1, 4)))
        n = len(self.tokens[s])
        if self._append(s, new, range(n, n + len(new))):
            self.tokens[s] += new

    def truncate(self, s):
        keep = int(self.rng.integers(0, len(self.tokens[s]) + 1))
        self.cache.truncate([s], [keep])
        del self.tokens[s][keep:]

    def free(self, s):
        self.cache.free(s)
        del self.tokens[s]

    def verify(self, s, others):
        """A tree of drafts appended at their depths, attended beside plain
        decoding queries of other sequences, then a random path kept."""
        n = int(self.rng.integers(1, 7))
        parents = [-1] + [int(self.rng.integers(0, i)) for i in range(1, n)]
        tree, depth = np.zeros((n, n), bool), np.zeros(n, np.int64)
        for i, p in enumerate(parents):
            tree[i] = tree[p] if p >= 0 else False
            tree[i, i] = True
            depth[i] = depth[p] + 1 if p >= 0 else 0
        drafts = list(self.rng.integers(0, 50, n))
        held = len(self.tokens[s])
        before = list(self.tokens[s])
        if not self._append(s, drafts, held + depth, draft=bool(self.rng.integers(2))):
            return
        ids = [s] + [o for o in dict.fromkeys(others) if o != s and self.tokens[o]]
        q_lens = [n] + [1] * (len(ids) - 1)
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        query = self.rng.standard_normal((int(cu[-1]), HQ, E)).astype(np.float32)
        out = self.cache.attend(ids, query, cu, tree_mask=tree.ravel(),
                                tree_mask_indptr=np.array([0] + [n * n] * len(ids)))
        # the reference: each sequence's rows from its shadow, drafts at their depths
        keys, values, lens = [], [], []
        for o in ids:
            pos = list(range(len(self.tokens[o])))
            tok = list(self.tokens[o])
            if o == s:
                tok, pos = tok + drafts, pos + list(held + depth)
            k, v = rows(tok, pos)
            keys.append(k)
            values.append(v)
            lens.append(len(tok))
        table = np.arange(len(ids) * max(lens)).reshape(len(ids), max(lens))
        kc = np.zeros((table.size, H, 1, E))
        vc = np.zeros((table.size, H, 1, E))
        for b, (k, v) in enumerate(zip(keys, values)):
            kc[table[b, :len(k)], :, 0] = k
            vc[table[b, :len(v)], :, 0] = v
        want = ref.paged_attention(query.astype(np.float64), kc, vc, table, np.array(lens), cu,
                                   tree_mask=tree.ravel(),
                                   tree_mask_indptr=np.array([0] + [n * n] * len(ids)))
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
        node = int(self.rng.integers(n))  # the path from the root to a node
        path = [i for i in range(n) if tree[node, i]]
        self.cache.accept_draft([s], [n], [path])
        self.tokens[s] += [drafts[i] for i in path]
        if self.rng.integers(2):  # a request whose prompt is the drafts in tree order
            self.add(before + drafts + [7])

    def _append(self, s, ids, positions, draft=False):
        """Rows of ids at positions appended to s; False (nothing written)
        when the pool lacks the blocks."""
        if not len(ids):
            return True
        k, v = rows(ids, positions)
        try:
            self.cache.append([s], k, v, np.array([0, len(ids)]), token_ids=np.array(ids),
                              draft=draft)
        except fastattn.OutOfBlocksError:
            return False
        return True

    # ---- the checks ---------------------------------------------------------
    def check(self):
        c = self.cache
        assert c.seq_lens == {s: len(t) for s, t in self.tokens.items()}
        holders = {}
        for s, tok in self.tokens.items():
            table = c.block_table([s])[0]
            blocks = table[:-(-len(tok) // BS)] if tok else table[:0]
            assert len(blocks) == -(-len(tok) // BS) and (table[len(blocks):] == -1).all()
            for b in set(blocks.tolist()):
                holders[b] = holders.get(b, 0) + 1
            j = np.arange(len(tok))
            k, v = rows(tok, j)
            np.testing.assert_array_equal(c.key_cache[blocks[j // BS], :, j % BS], k)
            np.testing.assert_array_equal(c.value_cache[blocks[j // BS], :, j % BS], v)
        assert c.num_free_blocks == BLOCKS - len(holders)
        assert all(c._refs[b] == n for b, n in holders.items())

    def step(self):
        live = list(self.tokens)
        op = self.rng.choice(["add", "fork", "decode", "verify", "truncate", "free"],
                             p=[0.2, 0.08, 0.3, 0.25, 0.07, 0.1])
        if op == "add" or not live:
            self.add()
            return
        s = live[self.rng.integers(len(live))]
        if op == "verify":
            self.verify(s, [live[i] for i in self.rng.integers(0, len(live), 3)])
        elif op == "fork" and len(live) < 12:
            self.fork(s)
        elif op in ("decode", "truncate", "free"):
            getattr(self, op)(s)
        while len(self.tokens) > 10:  # the server's finished requests
            self.free(next(iter(self.tokens)))


@pytest.mark.parametrize("seed", range(4))
def test_random_serving_workloads(seed):
    w = Workload(seed)
    for _ in range(600):
        w.step()
        w.check()
    assert w.cache._prefix.idle >= 0
