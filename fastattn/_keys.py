"""What a cache does to its keys before storing them, when asked: a Hadamard
rotation of the head dimension (``rotate_k``) and the subtraction of a
per-channel key mean (``smooth_k``).  Both lower the error of the quantised
storages on keys whose channels have outliers or a bias, and neither
changes a logit in exact arithmetic: the queries are rotated alike, and the
kernels add ``scale * q . mean`` back to every score (fa_attn_args' k_mean)."""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from . import _checks as C
from . import _core, _runtime
from ._typing import NDArray


def hadamard_block(n: int) -> int:
    """The order of the Sylvester-Hadamard blocks of a head of n features:
    the largest power of two dividing n (n itself when it is one)."""
    return n & -n if n > 0 else 1


@functools.lru_cache(maxsize=None)
def hadamard(n: int, dtype: str) -> NDArray[Any]:
    """The n x n orthonormal, symmetric rotation: Sylvester's Hadamard
    matrix of order p = hadamard_block(n) over sqrt(p), repeated along the
    diagonal (n = 80: five blocks of 16), so that it is its own inverse;
    read-only, made once per size."""
    p = hadamard_block(n)
    h = np.ones((1, 1))
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    m = np.kron(np.eye(n // p if n else 0), h / np.sqrt(p)).astype(dtype)
    m.flags.writeable = False
    return m


def rotate(x: NDArray[Any]) -> NDArray[Any]:
    """x (..., n), float32 or float64, times the rotation (a new array), by
    fastattn's own product on one thread: a row's bits depend on nothing
    else (BLAS may round a row differently with more rows beside it), and
    a decoding step's few rows cost microseconds."""
    n = x.shape[-1]
    if x.size == 0:
        return np.empty_like(x)
    rows = np.ascontiguousarray(x).reshape(-1, n)
    out = np.empty_like(rows)
    _core.matmul(_runtime.isa(), rows, hadamard(n, x.dtype.name), out, 1)
    return out.reshape(x.shape)


class KeyTransform:
    """A cache's choice of rotation and smoothing, checked."""

    def __init__(self, smooth_k: object, rotate_k: object, latent: bool = False) -> None:
        self.smooth = C.check_bool(smooth_k, "smooth_k")
        self.rotate = C.check_bool(rotate_k, "rotate_k")
        if latent and (self.smooth or self.rotate):  # (latent: checked by the cache's core)
            raise ValueError("latent cannot go with smooth_k or rotate_k: a latent cache's "
                             "values are its stored keys, which those would change")

    def rotated(self, x: NDArray[Any]) -> NDArray[Any]:
        """x (..., head_dim), float32 or float64, rotated (a new array), or
        x itself without rotate_k."""
        return rotate(x) if self.rotate else x

    def stored(self, key: NDArray[Any], rotated: NDArray[Any], mean: Optional[NDArray[Any]]
               ) -> NDArray[Any]:
        """key as the cache stores it: rotated (self.rotated(key)), less
        mean (broadcast; None: none).  ValueError, naming the options, for
        a key with an inf or a NaN under rotate_k (spread over its block as
        infinities of both signs, its scores would be NaN instead of
        infinite), and for a row of finite keys that comes out not finite
        (the rotation multiplies a row's largest by up to sqrt(head_dim))."""
        if self.rotate and not np.isfinite(key).all():
            raise ValueError("key holds an inf or a NaN, which rotate_k would spread over its "
                             "block of features (scores NaN instead of infinite); create the "
                             "cache without rotate_k to hold such keys")
        with np.errstate(over="ignore", invalid="ignore"):
            y = rotated if mean is None else rotated - mean
        if (self.rotate or mean is not None) and not np.isfinite(y).all():
            lost = np.isfinite(key).all(axis=-1) & ~np.isfinite(y).all(axis=-1)
            if lost.any():
                verb = "transform" if self.smooth and self.rotate else "transforms"
                raise ValueError(
                    f"key: a row of finite keys (largest {float(np.abs(key[lost]).max()):.3g}) "
                    f"is not finite once {self.options()} {verb} it ({self.what()}) in "
                    f"{key.dtype}; scale the keys down or create the cache without "
                    f"{self.options()}")
        return y

    def options(self) -> str:
        """"smooth_k and rotate_k", "smooth_k", "rotate_k" or ""."""
        return " and ".join(n for n, on in (("smooth_k", self.smooth), ("rotate_k", self.rotate))
                            if on)

    def what(self) -> str:
        """What the options do to a key: "rotated, less the prompt's mean"."""
        return ", ".join(w for w, on in (("rotated", self.rotate),
                                         ("less the prompt's mean", self.smooth)) if on)

    def options_repr(self) -> str:
        """"smooth_k=True, rotate_k=True, " (those set) for a cache's repr."""
        return "".join(f"{n}=True, " for n, on in (("smooth_k", self.smooth),
                                                   ("rotate_k", self.rotate)) if on)

    def explain(self, exc: ValueError, key: NDArray[Any]) -> ValueError:
        """A storage's error about the stored keys, saying they are
        transformed (not when the caller's keys were not finite: the
        storage's message is about them)."""
        if not (self.smooth or self.rotate) or not np.isfinite(key).all():
            return exc
        return ValueError(f"{exc} (the keys as {self.options()} store them: {self.what()}, "
                          "whose largest may exceed the keys given)")

    @staticmethod
    def mean(keys: NDArray[Any], real: Optional[NDArray[np.bool_]], axis: int) -> NDArray[Any]:
        """The mean of keys along axis (the positions) over the real ones
        (real broadcast against keys without their last axis; None: all)
        whose element is finite, summed in float64, in keys' dtype; 0 where
        none is (a NaN or inf key must not spread to every stored row)."""
        valid = np.isfinite(keys)
        if real is not None:
            valid &= np.broadcast_to(real, keys.shape[:-1])[..., None]
        total = np.where(valid, keys, 0).sum(axis=axis, dtype=np.float64)
        n = valid.sum(axis=axis)
        mean: NDArray[Any] = (total / np.maximum(n, 1)).astype(keys.dtype)
        return mean


class KeyOptions:
    """The options' read-only properties of a cache that holds a
    KeyTransform as _keys (KVCache, PagedKVCache, ShardedKVCache)."""

    _keys: KeyTransform

    @property
    def smooth_k(self) -> bool:
        """Whether keys are stored less their mean (the class's smooth_k)."""
        return self._keys.smooth

    @property
    def rotate_k(self) -> bool:
        """Whether keys are stored rotated (the class's rotate_k)."""
        return self._keys.rotate
