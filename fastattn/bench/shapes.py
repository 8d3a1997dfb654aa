"""The shapes of the benchmark, and what a call of each costs."""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class Shape:
    """One attention problem: query (B, H, L, E), key (B, Hkv, S, E), value
    (B, Hkv, S, Ev), float32 (Hkv = kv_heads, or H; Ev = value_dim, or E;
    latent: the values are the keys' first Ev features, a view, as
    Multi-head Latent Attention's cache holds them).

    kind says how its speed is reported: "compute" in GFLOP/s, "decode"
    (one query row) in GB/s of key and value read, "overhead" (a tiny
    problem) in microseconds per call, "memory" only by its peak memory.

    window >= 0: a causal sliding window, each query sees itself and the
    window keys before it (window_size=(window, 0)).  seqlens: packed
    sequences of these lengths, L = S = their sum, each attending to its
    own positions only (causally when causal).  storage: how a decoding
    case holds its keys and values, a fastattn KVCache's storage ("float32",
    "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2" or
    "int4"); only fastattn runs the others."""
    name: str
    B: int
    H: int
    L: int
    S: int
    E: int
    causal: bool = False
    kind: str = "compute"
    window: int = -1
    seqlens: Tuple[int, ...] = ()
    storage: str = "float32"
    kv_heads: int = 0
    value_dim: int = 0
    latent: bool = False

    @property
    def Ev(self):
        return self.value_dim or self.E

    @property
    def Hkv(self):
        return self.kv_heads or self.H

    @property
    def flops(self):
        """2·L·S·E for Q Kᵀ plus 2·L·S·Ev for the weighted sum, per head
        (4·B·H·L·S·E when E = Ev), halved when causal; for a window or
        packed sequences, over the (query, key) pairs that are visible."""
        pairs = self.L * self.S
        if self.window >= 0:  # row i sees min(i + 1, window + 1) keys
            w = self.window + 1
            pairs = w * (w + 1) // 2 + (self.L - w) * w if self.L > w else self.L * (self.L + 1) // 2
        elif self.seqlens:
            pairs = sum(n * (n + 1) // 2 if self.causal else n * n for n in self.seqlens)
        elif self.causal:
            pairs //= 2
        return 2 * self.B * self.H * pairs * (self.E + self.Ev)

    def mask(self) -> Optional[np.ndarray]:
        """The (L, S) bool mask (True = may attend) of a window or of packed
        sequences, as a library without those options is given it; None
        where is_causal alone says it."""
        i, j = np.arange(self.L)[:, None], np.arange(self.S)[None, :]
        if self.window >= 0:
            return (j <= i) & (j >= i - self.window)
        if self.seqlens:
            seq = np.repeat(np.arange(len(self.seqlens)), self.seqlens)
            same = seq[:, None] == seq[None, :]
            return same & (j <= i) if self.causal else same
        return None

    @property
    def kv_bytes(self):
        """Bytes of key and value in their storage (int8 and e4m3 with a
        float32 scale per row, int4 with a float16 scale per 32 elements):
        what a decoding step must read."""
        from fastattn._storage import SCALED, width  # (the bench imports fastattn late)
        rows, st = self.B * self.Hkv * self.S, self.storage
        scales = 8 if st in SCALED else 0  # a float32 per key row and per value row
        values = 0 if self.latent else width(st, self.Ev)  # (latent: the keys' own)
        return rows * (STORAGE_BYTES[st] * (width(st, self.E) + values) + scales)

    def stored_kv(self, seed=0):
        """The arrays a decoding step reads (key, value, and row scales),
        as float32 views of their bytes (for the read bandwidth on the same
        bytes): a fastattn KVCache of this storage filled with inputs()."""
        import fastattn

        _, k, v = self.inputs(seed)
        if self.storage == "float32":
            return [k] if self.latent else [k, v]
        cache = fastattn.KVCache(self.B, self.H, self.S, self.E, value_dim=self.Ev,
                                 storage=self.storage)
        cache.append(k, v)
        held = [cache._key, cache._value, cache._key_scale, cache._value_scale]
        return [a.reshape(-1).view(np.float32) for a in held if a is not None]

    @property
    def io_bytes(self):
        """Bytes of the inputs and the output (float32)."""
        return 4 * self.B * self.H * (self.L * self.E + self.L * self.Ev) + self.kv_bytes

    @property
    def scores_bytes(self):
        """Bytes of the L x S float32 score matrix of every head: what an
        implementation that materialises it holds at once."""
        return 4 * self.B * self.H * self.L * self.S

    def describe(self):
        heads = f"H={self.H}" + (f"/{self.Hkv}" if self.Hkv != self.H else "")
        dims = f"E=Ev={self.E}" if self.Ev == self.E else f"E={self.E} Ev={self.Ev}"
        return (f"B={self.B} {heads} L={self.L} S={self.S} {dims}"
                + (" latent" if self.latent else "")
                + (f" {self.storage} cache" if self.storage != "float32" else "")
                + (" causal" if self.causal else "")
                + (f" window {self.window}" if self.window >= 0 else "")
                + (f" {len(self.seqlens)} packed sequences of {min(self.seqlens)}.."
                   f"{max(self.seqlens)}" if self.seqlens else ""))

    def inputs(self, seed=0):
        """query, key, value: float32 standard normal, C-contiguous (B, H, ., E).

        With 1/sqrt(E) scaling the scores have unit variance, the regime of
        trained models."""
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((self.B, self.H, self.L, self.E), dtype=np.float32)
        k = rng.standard_normal((self.B, self.Hkv, self.S, self.E), dtype=np.float32)
        if self.latent:
            return q, k, k[..., :self.Ev]
        v = rng.standard_normal((self.B, self.Hkv, self.S, self.Ev), dtype=np.float32)
        return q, k, v


# bytes per element of the array that holds each storage of a key/value
# cache (int8 and e4m3 add their row scales; int4 rows are bytes of q4_0
# blocks, _storage.width of them)
STORAGE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "float8_e4m3fn": 1,
                 "float8_e5m2": 1, "int4": 1}
# 16 sequences of 32..1024 tokens, as a server packs them
PACKED = tuple(int(n) for n in np.linspace(32, 1024, 16).round())
# The benchmark table.
SHAPES = (
    Shape("bert-base", 1, 12, 128, 128, 64),
    Shape("minilm-batch", 32, 12, 128, 128, 32),
    Shape("encoder-512", 1, 8, 512, 512, 64),
    Shape("causal-2048", 1, 8, 2048, 2048, 64, causal=True),
    Shape("decode-4096", 1, 32, 1, 4096, 128, kind="decode"),
    Shape("long-8192", 1, 4, 8192, 8192, 64),
    Shape("head-128", 1, 8, 1024, 1024, 128),
    # the variants: a sliding window and its full causal case, packed sequences
    Shape("window-8192", 1, 4, 8192, 8192, 64, causal=True, window=1024),
    Shape("causal-8192", 1, 4, 8192, 8192, 64, causal=True),
    Shape("packed-16", 1, 8, sum(PACKED), sum(PACKED), 64, causal=True, seqlens=PACKED),
    # a decoding step over a long cache in each storage
    *(Shape(f"decode-8192{'' if st == 'float32' else '-' + st}", 1, 32, 1, 8192, 128,
            kind="decode", storage=st) for st in STORAGE_BYTES),
    # Multi-head Latent Attention's decoding step in its absorbed form
    # (DeepSeek-V3): 128 query heads over one latent head of 512 + 64,
    # the values its first 512 features; a matrix product, not a stream
    Shape("decode-mla-8192", 1, 128, 1, 8192, 576, kv_heads=1, value_dim=512, latent=True),
)
# Call time where the work is negligible: what the Python side costs.
TINY = Shape("tiny", 1, 1, 4, 4, 8, kind="overhead")
# The memory target: at most 64 MB above the inputs and the output.
LONG_16384 = Shape("long-16384", 1, 8, 16384, 16384, 64, kind="memory")

ALL_SHAPES = {s.name: s for s in SHAPES + (TINY, LONG_16384)}
# The thread counts measured by default.
THREADS = (1, 2)
