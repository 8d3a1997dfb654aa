"""Calls as a user writes them, with the types mypy must infer (checked by
.ci/typecheck.sh, never run): the overloads on need_weights, the dtype
carried from the inputs to the output, MultiHeadAttention's pair."""
from typing import Any, Optional, Union

import numpy as np
from numpy.typing import NDArray
from typing_extensions import assert_type

import fastattn

F32 = NDArray[np.float32]
Floating = NDArray[np.floating[Any]]

q = np.zeros((2, 4, 8, 16), np.float32)
pad = np.ones((2, 8), bool)

assert_type(fastattn.scaled_dot_product_attention(q, q, q), F32)
assert_type(fastattn.scaled_dot_product_attention(q, q, q, attn_mask=pad[:, None, None, :],
                                                  need_weights=True), tuple[F32, F32])
wanted: bool = bool(np.random.default_rng().integers(2))
assert_type(fastattn.scaled_dot_product_attention(q, q, q, need_weights=wanted),
            Union[F32, tuple[F32, F32]])
assert_type(fastattn.matmul(q, q), F32)
assert_type(fastattn.softmax(q, -1, mask=pad[:, None, None, :]), F32)
assert_type(fastattn.split_heads(np.zeros((2, 8, 64), np.int8), 4), NDArray[np.int8])
assert_type(fastattn.merge_heads(q), F32)

mha = fastattn.MultiHeadAttention(64, 4)
x = np.zeros((2, 8, 64), np.float32)
y, w = mha(x, key_padding_mask=~pad)
assert_type(y, Floating)
assert_type(w, Optional[Floating])

cache = mha.new_cache(2, 16)
assert_type(cache, fastattn.KVCache)
cache.append(np.zeros((2, 4, 8, 16), np.float32), np.zeros((2, 4, 8, 16), np.float32))
assert_type(cache.attend(q), F32)
assert_type(cache.attend(q, need_weights=True), tuple[F32, F32])
assert_type(cache.lengths, NDArray[np.int64])

assert_type(fastattn.simd_path(), str)
assert_type(fastattn.available_simd_paths(), list[str])
assert_type(fastattn.get_num_threads(), int)
