"""MultiHeadAttention: the whole attention layer (projections, heads,
attention, output projection) with PyTorch nn.MultiheadAttention's weights."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Tuple, Union, cast

import numpy as np

from . import _checks as C
from . import _masks, _runtime
from ._storage import narrow
from ._typing import DTypeLike, MaskArray, NDArray
from .attention import scaled_dot_product_attention
from .kv_cache import KVCache
from .paged_cache import PagedKVCache
from .ops import split_heads

Array = NDArray[np.floating[Any]]  # float32 or float64: the module's dtype
# What numpy.random.default_rng takes as a seed.
RNGLike = Union[np.random.Generator, np.random.BitGenerator, np.random.SeedSequence, int,
                Sequence[int], None]


class MultiHeadAttention:
    """Multi-head attention (Vaswani et al. 2017, sec. 3.2.2) with the
    parameters, state-dict names and mask conventions of PyTorch's
    ``torch.nn.MultiheadAttention``, and grouped-query attention
    (Ainslie et al. 2023) as an extension.

    ``MultiHead(Q, K, V) = Concat(head_1..head_h) W_O^T + b_O`` with
    ``head_i = Attention(Q W_Qi^T + b_Qi, K W_Ki^T + b_Ki, V W_Vi^T + b_Vi)``.
    The projections are matrix products of NumPy's BLAS; the heads are
    views of the projections (no copy); attention writes each head straight
    into the concatenated (L, embed_dim) buffer that the output projection
    reads.

    Parameters
    ----------
    embed_dim : int
        Model size E of query and output; a multiple of num_heads.
    num_heads : int
        Query heads H; head_dim = embed_dim // num_heads.
    kdim, vdim : int or None
        Features of key and value (cross-attention); None means embed_dim.
    num_kv_heads : int or None
        Key/value heads Hkv (grouped-query attention when < num_heads;
        num_heads must be a multiple).  None means num_heads.  PyTorch's
        module has no such argument: with Hkv < H the key and value
        projections have Hkv * head_dim rows instead of embed_dim.
    bias : bool
        Add in_proj_bias and out_proj.bias.
    batch_first : bool
        Inputs and output are (N, L, E) when True, (L, N, E) when False.
        True by default here; PyTorch's default is False.
    dtype : float32, float64, float16 or bfloat16
        Of the weights, the inputs and the output.  float16 and bfloat16
        (ml_dtypes' dtype) are computed in float32, as PyTorch computes a
        half-precision module on the CPU: the projections with float32
        copies of the weights, made when weights are set (the 16-bit
        arrays themselves are then read-only: change them with
        ``load_state_dict``), the attention reading float32 projections;
        only the output (and the weights returned) are rounded to dtype.
    rng : numpy.random.Generator, int or None
        Source of the initial weights, drawn as PyTorch draws them: Xavier
        uniform for the input projections (Glorot & Bengio 2010), uniform
        in +-1/sqrt(embed_dim) for the output projection, zero biases.
        Usually replaced by ``load_state_dict`` or ``from_torch``.

    Attributes
    ----------
    in_proj_weight : ndarray (embed_dim + 2 * Hkv * head_dim, embed_dim) or None
        Rows q; k; v, when kdim == vdim == embed_dim.  Every weight is a
        NumPy array of dtype, named as in the PyTorch state dict.
    q_proj_weight, k_proj_weight, v_proj_weight : ndarray or None
        (embed_dim, embed_dim), (Hkv * head_dim, kdim) and (Hkv * head_dim,
        vdim), when kdim or vdim differ.
    in_proj_bias : ndarray (embed_dim + 2 * Hkv * head_dim,) or None
    out_proj_weight, out_proj_bias : ndarray
        "out_proj.weight" (embed_dim, embed_dim) and "out_proj.bias"
        (embed_dim,) in the state dict (the bias None without bias).

    Raises
    ------
    TypeError
        Sizes that are not ints, a flag that is not a bool, or a dtype
        other than those above.
    ValueError
        Sizes below 1, embed_dim not a multiple of num_heads, or num_heads
        not a multiple of num_kv_heads.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 bias: bool = True, batch_first: bool = True, dtype: DTypeLike = np.float32,
                 rng: RNGLike = None) -> None:
        self.embed_dim = C.check_index(embed_dim, "embed_dim", 1)
        self.num_heads = C.check_index(num_heads, "num_heads", 1)
        self.kdim = self.embed_dim if kdim is None else C.check_index(kdim, "kdim", 1)
        self.vdim = self.embed_dim if vdim is None else C.check_index(vdim, "vdim", 1)
        self.num_kv_heads = (self.num_heads if num_kv_heads is None
                             else C.check_index(num_kv_heads, "num_kv_heads", 1))
        bias = C.check_bool(bias, "bias")
        self.batch_first = C.check_bool(batch_first, "batch_first")
        self.dtype = C.check_float_dtype(dtype, "dtype", half=True)
        self._compute = C.compute_dtype(self.dtype)  # float32 for the 16-bit dtypes
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim ({self.embed_dim}) must be a multiple of num_heads "
                             f"({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        self.head_dim = self.embed_dim // self.num_heads
        self._qkv_same_embed_dim = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        self._params: dict[str, Array] = {
            name: np.zeros(shape, self.dtype) for name, shape in self._param_shapes(bias).items()}
        self._init_weights(np.random.default_rng(rng))
        self._set_compute_weights()

    # ---- parameters -------------------------------------------------------
    def _set_compute_weights(self) -> None:
        """The weights the products read: the parameters themselves, or
        float32 copies of 16-bit ones (which become read-only, so that no
        change escapes the copies)."""
        if self._compute == self.dtype:
            self._weights = self._params
            return
        self._weights = {name: a.astype(self._compute) for name, a in self._params.items()}
        for name, a in self._params.items():
            frozen = a.view(_FrozenWeight)
            frozen.flags.writeable = False
            self._params[name] = frozen

    @property
    def kv_dim(self) -> int:
        """Rows of the key and value projections, num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def _param_shapes(self, bias: bool) -> dict[str, C.Shape]:
        E, kv = self.embed_dim, self.kv_dim
        if self._qkv_same_embed_dim:
            shapes: dict[str, C.Shape] = {"in_proj_weight": (E + 2 * kv, E)}
        else:
            shapes = {"q_proj_weight": (E, E), "k_proj_weight": (kv, self.kdim),
                      "v_proj_weight": (kv, self.vdim)}
        if bias:
            shapes["in_proj_bias"] = (E + 2 * kv,)
        shapes["out_proj.weight"] = (E, E)
        if bias:
            shapes["out_proj.bias"] = (E,)
        return shapes

    def _init_weights(self, rng: np.random.Generator) -> None:
        E, kv = self.embed_dim, self.kv_dim

        def uniform(shape: C.Shape, bound: float) -> Array:
            return rng.uniform(-bound, bound, shape).astype(self.dtype)

        def xavier(rows: int, cols: int) -> Array:  # fan_in = cols, fan_out = rows
            return uniform((rows, cols), np.sqrt(6.0 / (rows + cols)))

        p = self._params
        if self._qkv_same_embed_dim:  # PyTorch draws the packed matrix as one
            p["in_proj_weight"][...] = xavier(E + 2 * kv, E)
        else:
            p["q_proj_weight"][...] = xavier(E, E)
            p["k_proj_weight"][...] = xavier(kv, self.kdim)
            p["v_proj_weight"][...] = xavier(kv, self.vdim)
        p["out_proj.weight"][...] = uniform((E, E), 1.0 / np.sqrt(E))

    @property
    def in_proj_weight(self) -> Optional[Array]:
        return self._params.get("in_proj_weight")

    @property
    def q_proj_weight(self) -> Optional[Array]:
        return self._params.get("q_proj_weight")

    @property
    def k_proj_weight(self) -> Optional[Array]:
        return self._params.get("k_proj_weight")

    @property
    def v_proj_weight(self) -> Optional[Array]:
        return self._params.get("v_proj_weight")

    @property
    def in_proj_bias(self) -> Optional[Array]:
        return self._params.get("in_proj_bias")

    @property
    def out_proj_weight(self) -> Array:
        return self._params["out_proj.weight"]

    @property
    def out_proj_bias(self) -> Optional[Array]:
        return self._params.get("out_proj.bias")

    def state_dict(self) -> dict[str, Array]:
        """The weights by their PyTorch names (the arrays themselves, not copies)."""
        return dict(self._params)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load weights by the names of ``torch.nn.MultiheadAttention.state_dict()``.

        Parameters
        ----------
        state_dict : mapping of name -> array-like
            ``in_proj_weight`` (rows q; k; v) or ``q_proj_weight``,
            ``k_proj_weight``, ``v_proj_weight`` (when kdim or vdim differ
            from embed_dim), ``in_proj_bias``, ``out_proj.weight``,
            ``out_proj.bias`` (the biases when bias=True).  Any floating
            dtype, converted (copied) to this module's dtype.  NumPy arrays,
            or anything numpy.asarray reads, such as a CPU torch tensor that
            does not require grad.
        strict : bool
            When True every expected name must be present and no other.

        Raises
        ------
        ValueError
            Missing or unexpected names (with strict), a shape other than
            the expected one, or, in a 16-bit layer, a finite value beyond
            its dtype's range.
        TypeError
            A state_dict that is not a mapping, or an array that is not
            floating.

        Notes
        -----
        Nothing is loaded when an error is raised.
        """
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"state_dict must be a mapping of names to arrays, got "
                            f"{type(state_dict).__name__}")
        strict = C.check_bool(strict, "strict")
        expected = {name: a.shape for name, a in self._params.items()}
        if strict:
            missing = sorted(set(expected) - set(state_dict.keys()))
            unexpected = sorted(set(state_dict.keys()) - set(expected))
            if missing or unexpected:
                raise ValueError(f"state_dict does not match this MultiHeadAttention "
                                 f"({self!r}): missing {missing}, unexpected {unexpected}")
        new = {}
        for name, shape in expected.items():
            if name not in state_dict:
                continue
            a = _weights_array(state_dict[name])
            if not C.is_floating(a.dtype):
                raise TypeError(f"state_dict[{name!r}] has dtype {a.dtype}; expected a "
                                "floating dtype")
            if a.shape != shape:
                raise ValueError(f"state_dict[{name!r}] has shape {C.shape_str(a.shape)}; "
                                 f"expected {C.shape_str(shape)}")
            with np.errstate(over="ignore"):  # checked below
                new[name] = np.array(a, dtype=self.dtype, copy=True)
            if C.is_half(self.dtype):
                over = np.isfinite(a) & ~np.isfinite(new[name].astype(np.float32))
                if over.any():
                    raise ValueError(f"state_dict[{name!r}] holds {a[over].flat[0]}, beyond "
                                     f"the range of {self.dtype.name}; load it into a float32 "
                                     "MultiHeadAttention")
        self._params.update(new)
        self._set_compute_weights()

    @classmethod
    def from_torch(cls, module: Any) -> MultiHeadAttention:
        """A MultiHeadAttention with the sizes, layout and weights of a
        ``torch.nn.MultiheadAttention`` (needs torch only to read the module).
        Its dropout is not carried over: fastattn computes inference.  The
        layer gets the module's dtype: float32, float64, float16, or
        bfloat16 (ml_dtypes' dtype; NumPy has none, so its weights are read
        through float32, exactly).

        Raises
        ------
        ValueError
            The options fastattn does not implement (add_bias_kv,
            add_zero_attn).
        TypeError
            An object that is not a ``torch.nn.MultiheadAttention``.
        ImportError
            A bfloat16 module without ml_dtypes installed.
        """
        needed = ("embed_dim", "num_heads", "kdim", "vdim", "batch_first", "in_proj_bias",
                  "out_proj", "state_dict")
        if not all(hasattr(module, a) for a in needed):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got "
                            f"{type(module).__name__}")
        if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
            raise ValueError("add_bias_kv and add_zero_attn are not supported by fastattn")
        state = {k: _weights_array(v) for k, v in module.state_dict().items()}
        dtype = state["out_proj.weight"].dtype
        if str(module.out_proj.weight.dtype) == "torch.bfloat16":  # read through float32
            dtype = C.bfloat16("a bfloat16 module")
        mha = cls(module.embed_dim, module.num_heads, kdim=module.kdim, vdim=module.vdim,
                  bias=module.in_proj_bias is not None, batch_first=bool(module.batch_first),
                  dtype=dtype)
        mha.load_state_dict(state)
        return mha

    def __repr__(self) -> str:
        extra = "" if self._qkv_same_embed_dim else f", kdim={self.kdim}, vdim={self.vdim}"
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}"
                f"{extra}, bias={self.in_proj_bias is not None}, "
                f"batch_first={self.batch_first}, dtype={self.dtype.name})")

    def new_paged_cache(self, num_blocks: int, block_size: int, *,
                        storage: Optional[str] = None, smooth_k: bool = False,
                        rotate_k: bool = False) -> PagedKVCache:
        """An empty PagedKVCache for this layer: a pool of num_blocks blocks of
        block_size positions of (num_kv_heads, head_dim), in the dtype the
        layer computes in; storage, smooth_k and rotate_k as ``new_cache``'s."""
        if storage is None and self._compute != self.dtype:
            storage = self.dtype.name
        return PagedKVCache(num_blocks, block_size, self.num_kv_heads, self.head_dim,
                            dtype=self._compute, storage=storage, smooth_k=smooth_k,
                            rotate_k=rotate_k)

    def new_cache(self, batch_size: int, capacity: int, *,
                  storage: Optional[str] = None, smooth_k: bool = False,
                  rotate_k: bool = False) -> KVCache:
        """An empty KVCache sized for this layer: (batch_size, num_kv_heads,
        capacity, head_dim) in the dtype the layer computes in (float32 for
        a 16-bit layer).  storage: as KVCache's ("float32", "float16",
        "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2", "int4"); None
        holds it in the layer's dtype.  smooth_k and rotate_k: as KVCache's
        (the keys' mean and rotation, for the quantised storages).  Raises
        the errors of KVCache for a bad batch_size, capacity, storage or
        option."""
        if storage is None and self._compute != self.dtype:
            storage = self.dtype.name
        return KVCache(batch_size, self.num_kv_heads, capacity, self.head_dim,
                       dtype=self._compute, storage=storage, smooth_k=smooth_k,
                       rotate_k=rotate_k)

    # ---- forward ----------------------------------------------------------
    def forward(self, query: Array, key: Optional[Array] = None, value: Optional[Array] = None,
                key_padding_mask: Optional[MaskArray] = None, need_weights: bool = False,
                attn_mask: Optional[MaskArray] = None, average_attn_weights: bool = True,
                is_causal: Optional[bool] = None, *,
                cache: Optional[Union[KVCache, PagedKVCache]] = None,
                window_size: Optional[tuple[int, int]] = None,
                alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
                sinks: Optional[NDArray[Any]] = None,
                num_threads: Optional[int] = None, seq_ids: Optional[Sequence[int]] = None,
                cu_seqlens: Optional[NDArray[np.integer[Any]]] = None,
                rotary: Optional[tuple[NDArray[Any], NDArray[Any]]] = None,
                rotary_interleaved: bool = False,
                precision: str = "exact", positions: Optional[NDArray[np.integer[Any]]] = None,
                tree_mask: Optional[NDArray[np.bool_]] = None,
                tree_mask_indptr: Optional[NDArray[np.integer[Any]]] = None
                ) -> Tuple[Array, Optional[Array]]:
        """Attention of query over key/value, with the projections.

        The arguments up to is_causal have the names and order of
        ``torch.nn.MultiheadAttention.forward``; cache, the attention
        variants and num_threads are keyword-only.

        Parameters
        ----------
        query : ndarray (N, L, embed_dim) when batch_first, (L, N, embed_dim)
            otherwise, or (L, embed_dim) unbatched; the module's dtype.
        key : ndarray (N, S, kdim) / (S, N, kdim) / (S, kdim), or None
        value : ndarray (N, S, vdim) / (S, N, vdim) / (S, vdim), or None
            Both None: self-attention (key = value = query).  Any strides.
        key_padding_mask : ndarray (N, S) ((S,) unbatched) or None
            **nn.MultiheadAttention's convention: bool True = ignore this key**
            (padding); floating: added to the scores of that key.  The
            functional ``scaled_dot_product_attention`` uses the opposite
            bool convention (True = may attend); masks are converted here.
        attn_mask : ndarray (L, S) or (N * num_heads, L, S) ((num_heads, L, S)
            unbatched), or None
            Same convention: bool True = not allowed to attend; floating added.
            Either mask alone reaches the kernel as a broadcast view; both
            together are combined into one array of their broadcast shape,
            (N, 1 or num_heads, L, S).
        is_causal : bool or None
            Query i sees keys 0..i, or, with a cache, the keys up to its own
            position (bottom-right alignment).  None (the default) means True
            with a cache (a decoder's step) and False without.  PyTorch's module documents
            the same effect but treats the flag as a hint that attn_mask is
            causal; here no mask is needed, and with one a key is visible
            when both allow it.
        need_weights : bool
            Compute and return the attention weights (default False, which
            skips them; PyTorch's default is True).
        average_attn_weights : bool
            Weights averaged over the heads, (N, L, S), else per head
            (N, num_heads, L, S); unbatched without N.
        cache : KVCache, PagedKVCache or None
            Self-attention step of a decoder: the new keys and values
            (projected from key/value, or from query when omitted) are
            appended to the cache, and query attends to everything it holds;
            S is then ``cache.length`` after the append for attn_mask and the
            weights, while key_padding_mask (bool only) marks padding among
            the new positions.  The cache must have the batch size,
            num_kv_heads, head_dim and dtype of this layer
            (``new_cache`` makes one).  A PagedKVCache (``new_paged_cache``)
            serves a ragged batch: see seq_ids.
        seq_ids, cu_seqlens : with a PagedKVCache only
            The batch's sequences of the cache.  query (N, L, embed_dim)
            (batch_first; (L, N, embed_dim) otherwise) gives L new tokens to
            each of the N = len(seq_ids) sequences; or query packed
            (total, embed_dim) with cu_seqlens (B + 1,) gives seq_ids[b] the
            rows cu_seqlens[b] to cu_seqlens[b + 1] - 1 (one row each when
            cu_seqlens is None): prefill chunks and decoding tokens in one
            call.  Self-attention only (key and value None), no masks (each
            sequence sees its own positions), no weights.
        rotary, rotary_interleaved : with a PagedKVCache only
            Rotary position embedding of the queries and keys at each
            token's position in its sequence (``fastattn.rotary``'s
            (cos, sin) tables).
        positions, tree_mask, tree_mask_indptr : with a PagedKVCache only
            Speculative decoding's verify step: ``PagedKVCache.append``'s
            rotary positions of the new tokens (each draft token at its
            depth), and ``paged_attention``'s tree masks over them; then
            ``cache.accept_draft`` keeps the verified path.
        window_size, alibi_slopes, softcap, sinks
            The attention variants of ``scaled_dot_product_attention``
            (sliding window, ALiBi, soft-cap, sinks), per head of this layer;
            with a cache, positions count from the start of the cache.
        precision : {"exact", "int8"}
            "int8" (opt-in): without a cache, the int8 mode of
            ``scaled_dot_product_attention`` (SageAttention's 8-bit
            attention); with a cache in int8 storage, integer dot products
            against it, and in int4 storage for decoding steps, as
            ``KVCache.attend`` and ``paged_attention`` describe.  The
            default "exact" computes in float32 (float64 for a float64
            module) and reads a cache exactly.
        num_threads : int or None
            Threads of the attention kernel; the result is bitwise identical
            for any count.  NumPy's BLAS has its own threads, and OpenBLAS
            may round float32 projections differently for another BLAS
            thread count (last-bit differences); fix that count, for
            example with threadpoolctl, for bitwise reproducible outputs.

        Returns
        -------
        (output, weights), always a pair, as PyTorch returns it
        (``y, _ = mha(x)``):
        output : ndarray shaped like query, the module's dtype
        weights : ndarray or None
            None unless need_weights=True; then (N, L, S) averaged over the
            heads, or (N, num_heads, L, S); unbatched without N.

        Unlike PyTorch (which gives NaN), a query row with no visible key
        has zero attention output, so its output row is out_proj.bias (zeros
        without bias), never NaN.

        Raises
        ------
        TypeError
            Non-arrays, a dtype other than the module's, a mask neither
            bool nor floating, or a precision that is not a str.
        ValueError
            Shapes that disagree, only one of key and value, a cache that
            does not fit (its capacity included), or a precision other
            than "exact" and "int8".

        Notes
        -----
        The caller's arrays are never modified.
        """
        need_weights = C.check_bool(need_weights, "need_weights")
        average = C.check_bool(average_attn_weights, "average_attn_weights")
        is_causal = cache is not None if is_causal is None else C.check_bool(is_causal, "is_causal")
        _runtime.resolve_threads(num_threads)  # checked before a cache is written
        C.check_precision(precision)
        variants: dict[str, Any] = dict(window_size=window_size, alibi_slopes=alibi_slopes,
                                        softcap=softcap, sinks=sinks)
        with_cache: dict[str, Any] = dict(variants, precision=precision)
        if isinstance(cache, PagedKVCache):
            if key is not None or value is not None:
                raise ValueError("a PagedKVCache holds self-attention keys and values: pass query "
                                 "alone (key and value None)")
            if key_padding_mask is not None or attn_mask is not None or need_weights:
                raise ValueError("key_padding_mask, attn_mask and need_weights do not go with a "
                                 "PagedKVCache: each sequence sees its own positions, ragged, "
                                 "with no padding")
            return self._forward_paged(query, cache, seq_ids, cu_seqlens, is_causal, rotary,
                                       rotary_interleaved, positions,
                                       dict(with_cache, tree_mask=tree_mask,
                                            tree_mask_indptr=tree_mask_indptr), num_threads)
        if (seq_ids is not None or cu_seqlens is not None or rotary is not None
                or positions is not None or tree_mask is not None
                or tree_mask_indptr is not None):
            raise ValueError("seq_ids, cu_seqlens, rotary, positions and tree_mask go with a "
                             "PagedKVCache cache")
        self._check_inputs(query, key, value)
        batched = query.ndim == 3
        self_attention = key is None  # and value too (checked)
        if key is None or value is None:
            key = value = query
        if not batched:  # a batch of one, batch first (PyTorch ignores batch_first here)
            query, key, value = query[None], key[None], value[None]
            if isinstance(key_padding_mask, np.ndarray):
                if key_padding_mask.ndim != 1:
                    raise ValueError(f"key_padding_mask has shape "
                                     f"{C.shape_str(key_padding_mask.shape)}; unbatched inputs "
                                     f"take (S,) = ({key.shape[1]},) (True = ignore the key)")
                key_padding_mask = key_padding_mask[None]
        seq_first = batched and not self.batch_first
        N, L = query.shape[1::-1] if seq_first else query.shape[:2]
        Nk, S_new = key.shape[1::-1] if seq_first else key.shape[:2]
        if Nk != N or value.shape[:2] != key.shape[:2]:
            raise ValueError(f"query, key and value must have one batch size N, and key and "
                             f"value one length S; got query {C.shape_str(query.shape)}, key "
                             f"{C.shape_str(key.shape)}, value {C.shape_str(value.shape)} "
                             f"({'(L, N, E)' if seq_first else '(N, L, E)'} layout)")
        if cache is not None:
            self._check_cache(cache, N)
        S = S_new + (cache.length if cache is not None else 0)
        kpm = self._check_key_padding_mask(key_padding_mask, N, S_new, cache is not None)
        mask = self._attn_mask(attn_mask, N, L, S)

        if self._compute != self.dtype:  # the projections in float32, one copy per array
            converted = {id(a): a.astype(self._compute) for a in (query, key, value)}
            query, key, value = converted[id(query)], converted[id(key)], converted[id(value)]
        q, k, v = self._project(query, key, value, self_attention)
        q_h = self._heads(q, self.num_heads, seq_first)
        k_h = self._heads(k, self.num_kv_heads, seq_first)
        v_h = self._heads(v, self.num_kv_heads, seq_first)
        concat = np.empty(query.shape[:-1] + (self.embed_dim,), self._compute)
        out_h = self._heads(concat, self.num_heads, seq_first)  # attention writes here
        if cache is not None:
            length = cache.length
            cache.append(k_h, v_h, key_padding_mask=cast("Optional[NDArray[np.bool_]]", kpm))
            try:
                result = cache.attend(q_h, attn_mask=mask, is_causal=is_causal,
                                      need_weights=need_weights, out=out_h,
                                      num_threads=num_threads, **with_cache)
            except BaseException:  # KeyboardInterrupt: the step did not happen
                cache.truncate(length)
                raise
        else:
            if kpm is not None:
                kpm = _masks.from_mha(kpm, "key_padding_mask", self._compute)[:, None, None, :]
            result = scaled_dot_product_attention(
                q_h, k_h, v_h, attn_mask=_masks.both(mask, "attn_mask", kpm, "key_padding_mask",
                                                     self._compute),
                is_causal=is_causal, enable_gqa=True, need_weights=need_weights, out=out_h,
                num_threads=num_threads, precision=precision, **variants)
        w = self._weights
        output = _linear(concat, w["out_proj.weight"], w.get("out_proj.bias"))
        weights = result[1] if isinstance(result, tuple) else None  # need_weights
        if weights is not None and average:
            weights = weights.mean(axis=1)
        if self._compute != self.dtype:  # rounded once to the layer's 16-bit dtype
            nthreads = _runtime.resolve_threads(num_threads)
            output = narrow(output, self.dtype, nthreads)
            weights = None if weights is None else narrow(weights, self.dtype, nthreads)
        if not batched:
            return output[0], None if weights is None else weights[0]
        return output, weights

    __call__ = forward

    def _forward_paged(self, query: Array, cache: PagedKVCache, seq_ids: object,
                       cu_seqlens: Optional[NDArray[np.integer[Any]]], is_causal: bool,
                       rotary: Optional[tuple[NDArray[Any], NDArray[Any]]],
                       rotary_interleaved: bool, positions: Optional[NDArray[Any]],
                       variants: dict[str, Any],
                       num_threads: Optional[int]) -> Tuple[Array, Optional[Array]]:
        """forward with a PagedKVCache: the new tokens of a ragged batch
        projected, appended to their sequences and attended, packed."""
        if seq_ids is None:
            raise ValueError("a PagedKVCache needs seq_ids, the sequences of the batch")
        self._check_inputs(query, None, None)
        want = (self.num_kv_heads, self.head_dim, self.head_dim, self._compute)
        have = (cache.num_kv_heads, cache.head_dim, cache.value_dim, cache.dtype)
        if have != want:
            raise ValueError(f"cache {cache!r} does not fit this layer: it needs num_kv_heads="
                             f"{self.num_kv_heads}, head_dim=value_dim={self.head_dim}, "
                             f"dtype={self._compute.name}")
        before = cache.seq_lens_of(cast("Sequence[int]", seq_ids))  # (checks the ids)
        ids = cast("Sequence[int]", seq_ids)
        shape = query.shape
        if query.ndim == 3:  # (N, L, E) or (L, N, E): L tokens for each sequence
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens goes with a packed (total, embed_dim) query; a "
                                 "(N, L, embed_dim) one gives L tokens to each sequence")
            x = query if self.batch_first else query.transpose(1, 0, 2)
            if x.shape[0] != len(ids):
                raise ValueError(f"query holds {x.shape[0]} sequences and seq_ids {len(ids)}")
            cu_seqlens = np.arange(len(ids) + 1) * x.shape[1]
            x = x.reshape(-1, self.embed_dim)
        else:
            x = query
        if self._compute != self.dtype:  # the projections in float32
            x = x.astype(self._compute)
        q, k, v = self._project(x, x, x, True)
        total, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        concat = np.empty((total, self.embed_dim), self._compute)
        cache.append(ids, k.reshape(total, Hkv, D), v.reshape(total, Hkv, D), cu_seqlens,
                     rotary=rotary, rotary_interleaved=rotary_interleaved,
                     num_threads=num_threads, positions=positions)
        try:
            cache.attend(ids, q.reshape(total, H, D), cu_seqlens, is_causal=is_causal,
                         rotary=rotary, rotary_interleaved=rotary_interleaved,
                         positions=positions,
                         out=concat.reshape(total, H, D), num_threads=num_threads, **variants)
        except BaseException:  # KeyboardInterrupt: the step did not happen
            cache.truncate(ids, [int(n) for n in before])
            raise
        w = self._weights
        output = _linear(concat, w["out_proj.weight"], w.get("out_proj.bias"))
        if self._compute != self.dtype:
            output = narrow(output, self.dtype, _runtime.resolve_threads(num_threads))
        if query.ndim == 3:
            output = output.reshape(shape if self.batch_first else shape[1::-1] + shape[2:])
            output = output if self.batch_first else output.transpose(1, 0, 2)
        return output, None

    # ---- forward's pieces ---------------------------------------------------
    def _check_inputs(self, query: Array, key: Optional[Array], value: Optional[Array]) -> None:
        if (key is None) != (value is None):
            raise ValueError("pass both key and value (cross-attention) or neither "
                             "(self-attention)")
        arrays: dict[str, Array] = ({"query": query} if key is None or value is None
                                    else {"query": query, "key": key, "value": value})
        for name, a in arrays.items():
            C.require_array(a, name)
            if a.dtype != self.dtype:
                hint = (f"; for {a.dtype} inputs make the layer {a.dtype} (dtype= of "
                        f"MultiHeadAttention) or pass {name}.astype(np.{self.dtype.name})"
                        if C.is_half(a.dtype) or C.is_half(self.dtype) else "")
                raise TypeError(f"{name} has dtype {a.dtype}; this MultiHeadAttention has "
                                f"{self.dtype} weights{hint}")
        if query.ndim not in (2, 3):
            layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
            raise ValueError(f"query must be {layout} or unbatched (L, E), got shape "
                             f"{C.shape_str(query.shape)}")
        dims = {"query": ("embed_dim", self.embed_dim), "key": ("kdim", self.kdim),
                "value": ("vdim", self.vdim)}
        for name, a in arrays.items():
            if a.ndim != query.ndim:
                raise ValueError(f"{name} has shape {C.shape_str(a.shape)} and query "
                                 f"{C.shape_str(query.shape)}: they must have as many dimensions")
            what, dim = dims[name]
            if a.shape[-1] != dim:
                raise ValueError(f"{name} has {a.shape[-1]} features (last axis of "
                                 f"{C.shape_str(a.shape)}); expected {what} = {dim}")
        if key is None and not self._qkv_same_embed_dim:
            raise ValueError(f"self-attention needs kdim == vdim == embed_dim; this module has "
                             f"kdim={self.kdim}, vdim={self.vdim}: pass key and value")

    def _check_cache(self, cache: KVCache, N: int) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a fastattn.KVCache, got {type(cache).__name__}")
        want = (N, self.num_kv_heads, self.head_dim, self.head_dim, self._compute)
        have = (cache.batch_size, cache.num_kv_heads, cache.head_dim, cache.value_dim, cache.dtype)
        if have != want:
            raise ValueError(f"cache {cache!r} does not fit this layer: it needs batch_size={N}, "
                             f"num_kv_heads={self.num_kv_heads}, head_dim=value_dim="
                             f"{self.head_dim}, dtype={self._compute.name}")

    def _check_key_padding_mask(self, kpm: Optional[MaskArray], N: int, S: int,
                                with_cache: bool) -> Optional[MaskArray]:
        if kpm is None:
            return None
        C.require_array(kpm, "key_padding_mask")
        if kpm.shape != (N, S):
            raise ValueError(f"key_padding_mask has shape {C.shape_str(kpm.shape)}; expected "
                             f"(N, S) = ({N}, {S}) (True = ignore the key)")
        if with_cache and kpm.dtype != np.bool_:
            raise TypeError(f"key_padding_mask has dtype {kpm.dtype}; with a cache it must be "
                            "bool (True = padding)")
        return kpm

    def _attn_mask(self, mask: Optional[MaskArray], N: int, L: int,
                   S: int) -> Optional[NDArray[Any]]:
        """attn_mask (L, S) or (N * num_heads, L, S), True = ignore, as a
        functional-API mask broadcastable to (N, num_heads, L, S)."""
        if mask is None:
            return None
        C.require_array(mask, "attn_mask")
        H = self.num_heads
        if mask.shape == (L, S):
            pass
        elif mask.shape == (N * H, L, S):
            mask = mask.reshape(N, H, L, S)
        else:
            raise ValueError(f"attn_mask has shape {C.shape_str(mask.shape)}; expected (L, S) = "
                             f"({L}, {S}) or (N * num_heads, L, S) = ({N * H}, {L}, {S})")
        return _masks.from_mha(mask, "attn_mask", self._compute)

    def _project(self, query: Array, key: Array, value: Array,
                 self_attention: bool) -> tuple[Array, Array, Array]:
        """The input projections, (..., embed_dim) and twice (..., kv_dim),
        each a product with NumPy's BLAS (one when query = key = value)."""
        p = self._weights
        E, kv, b = self.embed_dim, self.kv_dim, p.get("in_proj_bias")
        bq, bk, bv = (None,) * 3 if b is None else (b[:E], b[E:E + kv], b[E + kv:])
        if not self._qkv_same_embed_dim:
            return (_linear(query, p["q_proj_weight"], bq), _linear(key, p["k_proj_weight"], bk),
                    _linear(value, p["v_proj_weight"], bv))
        w = p["in_proj_weight"]
        if self_attention:
            qkv = _linear(query, w, b)
            return qkv[..., :E], qkv[..., E:E + kv], qkv[..., E + kv:]
        q = _linear(query, w[:E], bq)
        if key is value:
            kv_ = _linear(key, w[E:], None if b is None else b[E:])
            return q, kv_[..., :kv], kv_[..., kv:]
        return q, _linear(key, w[E:E + kv], bk), _linear(value, w[E + kv:], bv)

    @staticmethod
    def _heads(x: Array, num_heads: int, seq_first: bool) -> Array:
        """(N, L, H*D) or (L, N, H*D) viewed as (N, H, L, D), no copy."""
        h = split_heads(x, num_heads)  # (A0, H, A1, D)
        return h.transpose(2, 1, 0, 3) if seq_first else h


class _FrozenWeight(np.ndarray):
    """A 16-bit layer's parameter: read-only, since the layer computes with
    float32 copies that a write would not reach; an item assignment says
    what to do instead (NumPy's own message says only "read-only")."""

    def __setitem__(self, index: Any, value: Any) -> None:
        raise ValueError("the weights of a 16-bit MultiHeadAttention are read-only (it "
                         "computes with float32 copies that a write would not reach): pass "
                         "the new values to load_state_dict({name: array, ...}, strict=False)")


def _weights_array(x: Any) -> NDArray[Any]:
    """An array of weights: NumPy's view of x, or for a torch tensor its
    values on the CPU, bfloat16 ones as float32 (NumPy has no bfloat16;
    every bfloat16 is a float32)."""
    if type(x).__module__.split(".")[0] == "torch":
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return np.asarray(x.numpy())
    return np.asarray(x)


def _linear(x: Array, weight: Array, bias: Optional[Array]) -> Array:
    """x @ weight^T + bias over the last axis, as one BLAS product."""
    y = x.reshape(-1, x.shape[-1]) @ weight.T
    if bias is not None:
        y += bias
    return y.reshape(x.shape[:-1] + (weight.shape[0],))
