"""fastattn: exact scaled dot-product attention on the CPU, with C/Cython
kernels under a strict NumPy API.

    >>> import numpy as np, fastattn
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 8, 128, 64), np.float32)
    >>> fastattn.scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (1, 8, 128, 64)
"""
from importlib.metadata import PackageNotFoundError, version as _version

from ._wait_policy import short_spin

try:
    with short_spin():  # OpenMP's idle threads: see _wait_policy
        from . import _core  # noqa: F401  (the compiled extension)
except ImportError as e:  # pragma: no cover - depends on how Python was started
    raise ImportError(
        "fastattn's compiled extension cannot be imported. Python found fastattn at "
        f"{__path__[0]!r}: if that is the source tree, start Python from another directory "
        "so that the installed package is used (pip install . builds it); otherwise "
        f"reinstall. Original error: {e}") from e

from . import reference
from ._runtime import (available_simd_paths, get_num_threads, openmp_enabled,
                       set_num_threads, set_simd_path, simd_path)
from .attention import merge_attention, scaled_dot_product_attention
from .backward import attention_backward, varlen_attention_backward
from .kv_cache import KVCache
from .mha import MultiHeadAttention
from .ops import matmul, merge_heads, softmax, split_heads
from .paged import paged_attention
from .paged_cache import OutOfBlocksError, PagedKVCache
from .rotary import rotary
from .varlen import varlen_attention

try:
    __version__ = _version("fastattn")
except PackageNotFoundError:  # running from a source tree that was built in place
    __version__ = "0+unknown"

__all__ = [
    "scaled_dot_product_attention", "attention_backward", "merge_attention", "varlen_attention",
    "paged_attention", "varlen_attention_backward",
    "MultiHeadAttention", "KVCache", "PagedKVCache", "OutOfBlocksError", "rotary", "matmul", "softmax",
    "split_heads", "merge_heads",
    "reference", "simd_path", "set_simd_path", "available_simd_paths", "openmp_enabled",
    "get_num_threads", "set_num_threads", "__version__",
]
