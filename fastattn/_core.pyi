# Types of the compiled extension fastattn/_core.pyx, for mypy: the names
# the Python layer uses.  The arrays are checked (dtype, shape, strides) by
# the Python layer before they reach these functions.
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

MAX_THREADS: int
SCRATCH_KEEP: int  # bytes of kernel scratch a Python thread keeps between calls
ISA_PORTABLE: int
ISA_AVX2: int
ISA_AVX512: int
ISA_NEON: int
MASK_NONE: int
MASK_BOOL: int
MASK_ADD: int
STORE_NATIVE: int
STORE_F16: int
STORE_BF16: int
STORE_I8: int
STORE_F8E4M3: int
STORE_F8E5M2: int
STORE_Q4: int
PRECISION_EXACT: int
PRECISION_INT8: int
PREFETCH_KEYS: int
PREFETCH_VALUES: int
PREFETCH_FAR: int
ATTN_MAX_FEATURES: int

def cpu_has_avx2_fma() -> bool: ...
def cpu_has_avx512() -> bool: ...
def cpu_has_avx512_vnni() -> bool: ...
def cpu_has_avx_vnni() -> bool: ...
def cpu_has_neon() -> bool: ...
def cpu_has_neon_fp16() -> bool: ...
def cpu_has_neon_bf16() -> bool: ...
def cpu_has_neon_dotprod() -> bool: ...
def have_openmp() -> bool: ...
def omp_max_threads() -> int: ...
def attn_query_block(elsize: int) -> int: ...
def attention(isa: int, q: NDArray[Any], k: NDArray[Any], v: NDArray[Any],
              mask: Optional[NDArray[Any]], mask_kind: int, out: NDArray[Any],
              weights: Optional[NDArray[Any]], group: int, causal: bool, causal_offset: int,
              scale: float, nthreads: int, prefetch: int = ..., window_left: int = ...,
              window_right: int = ...,
              softcap: float = ..., slopes: Optional[NDArray[np.float64]] = ...,
              sinks: Optional[NDArray[np.float64]] = ...,
              lse: Optional[NDArray[Any]] = ..., q_store: int = ..., kv_store: int = ...,
              k_scale: Optional[NDArray[np.float32]] = ...,
              v_scale: Optional[NDArray[np.float32]] = ...,
              ahead_blocks: bool = ..., precision: int = ...,
              key_mean: Optional[NDArray[Any]] = ..., int8_dot: bool = ...) -> None: ...
def ragged(isa: int, q: NDArray[Any], key_cache: NDArray[Any], value_cache: NDArray[Any],
           k_scale: Optional[NDArray[np.float32]], v_scale: Optional[NDArray[np.float32]],
           block_table: Optional[NDArray[np.int32]], kv_start: Optional[NDArray[np.int64]],
           seq_lens: NDArray[np.int64], cu_q: NDArray[np.int64], out: NDArray[Any],
           lse: Optional[NDArray[Any]], group: int, causal: bool, lower_right: bool,
           align_offset: int, scale: float, nthreads: int, window_left: int,
           window_right: int, softcap: float, slopes: Optional[NDArray[np.float64]],
           sinks: Optional[NDArray[np.float64]], q_store: int, kv_store: int,
           prefetch: int = ..., ahead_blocks: bool = ...,
           precision: int = ..., key_mean: Optional[NDArray[Any]] = ...,
           tree_mask: Optional[NDArray[np.bool_]] = ...,
           tree_at: Optional[NDArray[np.int64]] = ...,
           read: Optional[NDArray[np.int64]] = ..., int8_dot: bool = ...) -> None: ...
def rotary(x: NDArray[Any], positions: NDArray[np.int64], cos: NDArray[Any], sin: NDArray[Any],
           interleaved: bool, out: NDArray[Any], nthreads: int) -> None: ...
def softmax_rows(isa: int, x: NDArray[Any], mask: Optional[NDArray[Any]], mask_kind: int,
                 out: NDArray[Any], nthreads: int) -> None: ...
def matmul(isa: int, a: NDArray[Any], bm: NDArray[Any], out: NDArray[Any],
           nthreads: int) -> None: ...
def merge_heads(x: NDArray[Any], out: NDArray[Any], nthreads: int) -> None: ...
def narrow(isa: int, store: int, x: NDArray[np.float32], out: NDArray[Any], nthreads: int) -> None: ...
def int8_rows(isa: int, x: NDArray[np.float32], mean: Optional[NDArray[np.float32]],
              codes: NDArray[np.int8], scales: NDArray[np.float32], nthreads: int) -> int: ...
def col_sums(isa: int, x: NDArray[np.float32], out: NDArray[np.float64], nthreads: int) -> None: ...
def int8_operands(isa: int, k: NDArray[np.float32], v: NDArray[np.float32], nthreads: int
                  ) -> Optional[tuple[NDArray[np.int8], NDArray[np.float32], NDArray[np.int8],
                                      NDArray[np.float32], NDArray[np.float32]]]: ...
def exp(isa: int, x: NDArray[np.floating[Any]], out: NDArray[np.floating[Any]], mode: int = 0) -> None: ...
def grad_chunk_keys(S: int, kv_heads: int) -> int: ...
def attention_backward(isa: int, q: NDArray[Any], k: NDArray[Any], v: NDArray[Any],
                       mask: Optional[NDArray[Any]], mask_kind: int, out: NDArray[Any],
                       lse: NDArray[Any], dout: NDArray[Any], dq: NDArray[Any],
                       dk: NDArray[Any], dv: NDArray[Any], psum: NDArray[Any],
                       parts: NDArray[Any], sums: NDArray[Any], tasks: NDArray[np.int64],
                       merges: NDArray[np.int64], group: int, causal: bool,
                       causal_offset: int, scale: float, nthreads: int,
                       window_left: int = ..., window_right: int = ..., softcap: float = ...,
                       slopes: Optional[NDArray[Any]] = ...,
                       rnorm: Optional[NDArray[Any]] = ...) -> None: ...
def varlen_backward(isa: int, q: NDArray[Any], k: NDArray[Any], v: NDArray[Any],
                    out: NDArray[Any], lse: NDArray[Any], dout: NDArray[Any],
                    dq: NDArray[Any], dk: NDArray[Any], dv: NDArray[Any], psum: NDArray[Any],
                    parts: NDArray[Any], sums: NDArray[Any], tasks: NDArray[np.int64],
                    merges: NDArray[np.int64], cu_q: NDArray[np.int64],
                    cu_k: NDArray[np.int64], seq_lens: NDArray[np.int64], group: int,
                    causal: bool, lower_right: bool, align_offset: int, scale: float,
                    nthreads: int, window_left: int, window_right: int, softcap: float,
                    slopes: Optional[NDArray[Any]],
                    rnorm: Optional[NDArray[Any]] = ...) -> None: ...
