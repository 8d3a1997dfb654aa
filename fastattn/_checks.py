"""Argument checks shared by the public functions.  Every failure is a
TypeError or ValueError that names the argument, what was seen and what was
expected."""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np
from numpy.ma import MaskedArray
from numpy.typing import DTypeLike, NDArray

from . import _core

Shape = Tuple[int, ...]

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def shape_str(shape: Sequence[int]) -> str:
    """A shape as Python prints a tuple: (8,) for one axis."""
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _is_torch_tensor(x: object) -> bool:
    """Whether x is a torch.Tensor (or a subclass such as Parameter), told by
    its class's module and name: fastattn never imports torch."""
    return any(c.__name__ == "Tensor" and c.__module__.partition(".")[0] == "torch"
               for c in type(x).__mro__)


def require_array(x: object, name: str, dtype: str = "np.float32") -> NDArray[Any]:
    """x itself when it is a plain ndarray, else a TypeError that says how to
    make one (a list's hint names dtype, the one the argument expects)."""
    if type(x) is np.ndarray:
        return x
    if not isinstance(x, np.ndarray):
        if _is_torch_tensor(x):
            kind = type(x)
            raise TypeError(f"{name} must be a numpy.ndarray, got {kind.__module__}."
                            f"{kind.__name__}; pass {name}.numpy() ({name}.detach().cpu()"
                            ".numpy() for a tensor that requires grad or is not on the CPU)")
        hint = (f"; pass np.asarray({name}, dtype={dtype}) (or the dtype meant)"
                if isinstance(x, (list, tuple)) else "")
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}{hint}")
    if isinstance(x, MaskedArray):  # its mask would be silently ignored
        raise TypeError(f"{name} is a numpy.ma.MaskedArray, whose mask fastattn does not read; "
                        "pass a plain ndarray and express hidden entries with a mask argument")
    return x


def require_ndim(x: NDArray[Any], name: str, min_ndim: int, layout: str) -> None:
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions {layout}, "
                         f"got shape {shape_str(x.shape)}")


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def dtype_name(dtype: np.dtype[Any]) -> str:
    """dtype.name, remembered for the dtypes seen (up to 64 of them):
    NumPy's property builds the string in Python at every access, and a
    small call makes several (threads-and-speed.md, "Small calls")."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if len(_DTYPE_NAMES) < 64:
            _DTYPE_NAMES[dtype] = name
    return name


def is_half(dtype: np.dtype[Any]) -> bool:
    """float16, or bfloat16 (ml_dtypes' dtype, the one JAX and PyTorch's
    converters use): stored in 16 bits, computed in float32."""
    return dtype.itemsize == 2 and (dtype == np.float16 or dtype_name(dtype) == "bfloat16")


def bfloat16(what: str) -> np.dtype[Any]:
    """ml_dtypes' bfloat16, or an ImportError saying that what needs it."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(f"{what} needs the ml_dtypes package: pip install 'fastattn[bfloat16]' "
                          "(or pip install ml_dtypes)") from None
    bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16


def is_floating(dtype: np.dtype[Any]) -> bool:
    """NumPy's floating dtypes and bfloat16 (ml_dtypes' dtype, which NumPy
    does not count among them)."""
    return bool(np.issubdtype(dtype, np.floating)) or is_half(dtype)


def unsupported_float_hint(dtype: np.dtype[Any], name: str) -> str:
    """The fix for a half-precision array where only float32 and float64 are
    taken, to end a dtype error ('' otherwise)."""
    if is_half(dtype):
        return (f"; {dtype.name} is taken by scaled_dot_product_attention, paged_attention, "
                f"MultiHeadAttention and the caches' attend, not here: pass "
                f"{name}.astype(np.float32)")
    return ""


def byte_order_hint(dtype: np.dtype[Any], name: str) -> str:
    """The fix for a floating array in the other byte order ('' otherwise)."""
    if dtype.isnative or dtype.kind != "f":
        return ""
    return (f"; {dtype.str} is {dtype.newbyteorder('=').name} in the other byte order: pass "
            f"{name}.astype('={dtype.kind}{dtype.itemsize}')")


def common_float_dtype(**arrays: NDArray[Any]) -> np.dtype[Any]:
    """The one dtype (float32 or float64, native byte order) of all arrays."""
    for name, a in arrays.items():
        if a.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {a.dtype}; expected float32 or float64 "
                            f"(native byte order){unsupported_float_hint(a.dtype, name)}"
                            f"{byte_order_hint(a.dtype, name)}")
    return _one_dtype(arrays, "float32 or float64")


def attention_dtype(**arrays: NDArray[Any]) -> np.dtype[Any]:
    """The one dtype of the arrays of an attention call: float32, float64,
    float16 or bfloat16 (native byte order)."""
    for name, a in arrays.items():
        if a.dtype not in FLOAT_DTYPES and not (is_half(a.dtype) and a.dtype.isnative):
            raise TypeError(f"{name} has dtype {a.dtype}; expected float32, float64, float16 or "
                            f"bfloat16 (native byte order){byte_order_hint(a.dtype, name)}")
    return _one_dtype(arrays, "float32, float64, float16 or bfloat16")


def _one_dtype(arrays: Mapping[str, NDArray[Any]], allowed: str) -> np.dtype[Any]:
    dtypes = {a.dtype for a in arrays.values()}
    if len(dtypes) > 1:
        seen = ", ".join(f"{n} {a.dtype}" for n, a in arrays.items())
        raise TypeError(f"dtypes differ ({seen}); pass arrays of one dtype, {allowed}")
    return dtypes.pop()


def compute_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype the kernels compute an array of this dtype in."""
    return np.dtype(np.float32) if is_half(dtype) else dtype


def check_float_dtype(dtype: DTypeLike, name: str, half: bool = False) -> np.dtype[Any]:
    """numpy.dtype(dtype) when it is float32 or float64 (or, with half,
    float16 or bfloat16), else a TypeError."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    # (a dtype compares equal to None: float64)
    if dt is None or not (dt in FLOAT_DTYPES or (half and is_half(dt) and dt.isnative)):
        allowed = "float32, float64, float16 or bfloat16" if half else "float32 or float64"
        raise TypeError(f"{name} must be {allowed}, got {dtype!r}")
    return dt


def kernel_view(a: NDArray[Any]) -> NDArray[Any]:
    """a itself when the kernels can read it in place (aligned, every stride a
    whole number of elements), else an aligned contiguous copy."""
    flags = a.flags
    itemsize = a.itemsize  # 1 (a bool mask): every stride is whole, broadcast ones too
    if flags.aligned and (flags.c_contiguous or itemsize == 1
                          or all(s % itemsize == 0 for s in a.strides)):
        return a
    return np.array(a, order="C")  # a fresh array; ascontiguousarray keeps a misaligned one


def contiguous(a: NDArray[Any], dtype: Optional[DTypeLike] = None) -> NDArray[Any]:
    """a as a C-contiguous, aligned array of dtype, copied only when it is not
    one: np.ascontiguousarray keeps a misaligned array, which C may not read."""
    c = np.ascontiguousarray(a, dtype)
    return c if c.flags.aligned else np.array(c, order="C")


def broadcast_view(a: NDArray[Any], shape: Shape) -> NDArray[Any]:
    """a seen with shape (stride 0 on broadcast axes), without a copy."""
    if a.shape == shape:
        return a
    extra = len(shape) - a.ndim
    if extra > 0 and shape[extra:] == a.shape and shape[:extra] == (1,) * extra:
        return a[(None,) * extra]  # leading axes of 1 only: a tenth of broadcast_to's time
    return np.broadcast_to(a, shape)


def broadcast_shapes(named_shapes: Sequence[tuple[str, Shape]], what: str) -> Shape:
    """np.broadcast_shapes with an error that names the arguments."""
    first = named_shapes[0][1]
    if all(s == first for _, s in named_shapes):
        return tuple(first)
    seen = ", ".join(f"{n} {shape_str(s)}" for n, s in named_shapes)
    try:
        return np.broadcast_shapes(*(s for _, s in named_shapes))
    except ValueError:
        ndim = max(len(s) for _, s in named_shapes)
        if all(len({s[i] for _, s in named_shapes if len(s) >= -i} - {1}) <= 1
               for i in range(-ndim, 0)):  # compatible: NumPy refuses the size
            raise ValueError(f"{what} broadcast to more elements than a 64-bit index "
                             f"addresses: {seen}") from None
        raise ValueError(f"{what} do not broadcast: {seen}") from None
    except RuntimeError as e:  # NumPy broadcasts at most 32 dimensions
        raise ValueError(f"{what} cannot be broadcast: {e}") from None


_INDEX = np.iinfo(np.intp)


def max_elements(dtype: np.dtype[Any]) -> int:
    """Most elements of dtype one array can hold: its byte size must fit a
    signed pointer-sized index (NumPy's limit on every array, views included)."""
    return _INDEX.max // dtype.itemsize


def _counted_elements(shape: Shape) -> int:
    """Elements NumPy counts against its limit: zero-size shapes count their
    other axes."""
    return math.prod(d for d in shape if d)


def addressable(shape: Shape, itemsize: int) -> bool:
    """Whether NumPy can make an array, real or a view, of this shape."""
    return _counted_elements(shape) <= _INDEX.max // itemsize


def require_addressable(named_shapes: Sequence[tuple[str, Shape]], itemsize: int) -> None:
    """Refuse arrays, real or broadcast views, beyond max_elements: a clear
    error naming the array before any allocation or broadcast."""
    limit = _INDEX.max // itemsize
    for what, shape in named_shapes:
        if not addressable(shape, itemsize):
            n = _counted_elements(shape)
            raise ValueError(f"{what} {shape_str(shape)} would have {n} elements, more than a "
                             f"{_INDEX.bits}-bit index addresses ({limit} of {itemsize} bytes)")


def has_internal_overlap(a: NDArray[Any]) -> bool:
    """False when the elements of a provably occupy distinct memory: taken
    from the smallest stride up, each axis steps past all that the smaller
    ones span.  True for stride-0 and other self-overlapping views."""
    flags = a.flags
    if a.size == 0 or flags.c_contiguous or flags.f_contiguous:
        return False
    span = a.itemsize
    for stride, n in sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def overlap(a: NDArray[Any], b: NDArray[Any]) -> bool:
    """True when a and b may share an element: the cheap bounds test, then,
    for interleaved views within one buffer, NumPy's exact test (bounded;
    when it gives up the answer stays "may")."""
    if not np.may_share_memory(a, b):
        return False
    try:
        # numpy's stub admits only max_work -1 or 0; the function takes any bound
        return np.shares_memory(a, b, max_work=10_000)  # type: ignore[arg-type]
    except np.exceptions.TooHardError:
        return True


def check_out(out: NDArray[Any], shape: Shape, dtype: np.dtype[Any],
              inputs: Mapping[str, Optional[NDArray[Any]]], name: str = "out") -> NDArray[Any]:
    """A caller's output array: right type, dtype, shape; writeable; kernel
    readable strides; no memory shared with an input."""
    require_array(out, name)
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}; expected {dtype}")
    if out.shape != tuple(shape):
        raise ValueError(f"{name} has shape {shape_str(out.shape)}; expected {shape_str(shape)}")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")
    if kernel_view(out) is not out:
        raise ValueError(f"{name} must be aligned with strides that are whole elements")
    if has_internal_overlap(out):
        raise ValueError(f"{name} has elements that share memory (strides {out.strides}, a "
                         "broadcast or overlapping view); pass an array of distinct elements")
    for in_name, a in inputs.items():
        if a is not None and overlap(out, a):
            raise ValueError(f"{name} overlaps {in_name}; pass a separate output array")
    return out


def check_bool(x: object, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


PRECISIONS = {"exact": _core.PRECISION_EXACT, "int8": _core.PRECISION_INT8}


def check_precision(x: object) -> int:
    """The kernels' precision (fa_precision) for the public ``precision``
    argument: "exact" (the default) or "int8" (opt-in integer dot products
    against int8 and int4 caches)."""
    if not isinstance(x, str):
        raise TypeError(f'precision must be a str, "exact" or "int8", got {type(x).__name__}')
    if x not in PRECISIONS:
        raise ValueError(f'precision must be "exact" or "int8", got {x!r}')
    return PRECISIONS[x]


def check_real(x: object, name: str) -> float:
    """A finite real number (not a bool); a NumPy or ml_dtypes scalar of a
    16-bit float too (ml_dtypes' are not registered as numbers.Real)."""
    if isinstance(x, np.generic) and is_half(x.dtype):
        x = x.astype(np.float32)  # exact
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    try:
        y = float(x)
    except OverflowError:  # an int beyond float64
        raise ValueError(f"{name} must be finite, got {x}") from None
    if not math.isfinite(y):
        raise ValueError(f"{name} must be finite, got {y}")
    return y


def check_finite_in(values: object, name: str, compute: np.dtype[Any], times: float = 1.0) -> None:
    """ValueError unless every value (times `times`) stays finite once rounded
    to compute, the dtype the kernels compute in (1e300 is finite in float64,
    inf in float32)."""
    x = np.asarray(values, np.float64) * times
    with np.errstate(over="ignore"):
        big = np.isinf(x.astype(compute))
    if big.any():
        what = name if times == 1 else f"{name} x {times:g}"
        raise ValueError(f"{what} must be finite in {np.dtype(compute).name}, the dtype computed "
                         f"in; got {x[big].flat[0] / times}" + ("" if times == 1 else f" x {times:g}"))


def check_scale(scale: object, E: int, compute: np.dtype[Any]) -> float:
    """The scale the kernels take: 1/sqrt(E) when None (PyTorch's default),
    else a real number finite in the dtype computed in, and not 0 there
    unless it is 0 (a float32 kernel would take 1e-46 for 0: a plain mean)."""
    x = (1.0 / math.sqrt(E) if E > 0 else 1.0) if scale is None else check_real(scale, "scale")
    largest = LARGEST.get(compute, 0.0)
    if not -largest <= x <= largest:  # else plainly finite there
        check_finite_in(x, "scale", compute)
    if x != 0 and float(np.asarray(x).astype(compute)) == 0:
        raise ValueError(f"scale must round to a nonzero {np.dtype(compute).name}, the dtype "
                         f"computed in, or be 0; got {x!r}")
    return x


# each computing dtype's largest finite value, as a Python float
LARGEST = {np.dtype(t): float(np.finfo(t).max) for t in (np.float32, np.float64)}


def check_index(x: object, name: str, minimum: int) -> int:
    if isinstance(x, (bool, np.bool_)) or not hasattr(x, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = operator.index(x)
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def mask_kind_and_array(mask: Optional[NDArray[Any]], dtype: np.dtype[Any],
                        name: str) -> tuple[int, Optional[NDArray[Any]]]:
    """(kind, array) of a mask: bool masks stay bool (True = keep); floating
    masks are converted to dtype (added to the scores, -inf hides)."""
    if mask is None:
        return _core.MASK_NONE, None
    require_array(mask, name)
    if mask.dtype == np.bool_:
        return _core.MASK_BOOL, kernel_view(mask)
    if mask.dtype is dtype:  # no conversion, so nothing can overflow
        return _core.MASK_ADD, kernel_view(mask)
    if is_floating(mask.dtype):
        return _core.MASK_ADD, kernel_view(float_mask(mask, dtype, name))
    raise TypeError(f"{name} has dtype {mask.dtype}; expected bool (True = may attend) "
                    "or a floating dtype (added to the scores, -inf = hidden)")


def float_mask(mask: NDArray[Any], dtype: np.dtype[Any], name: str) -> NDArray[Any]:
    """A floating mask in dtype, the dtype computed in.  A value below its
    range becomes -inf and hides the key, as meant; a finite value above it
    would become +inf and give NaN rows: a ValueError, as a scale beyond it
    is."""
    if mask.dtype == dtype:
        return mask
    with np.errstate(over="ignore"):
        converted: NDArray[Any] = mask.astype(dtype)
    if mask.dtype.itemsize > dtype.itemsize:
        over = np.isposinf(converted) & ~np.isposinf(mask)
        if over.any():
            raise ValueError(f"{name} holds {mask[over].flat[0]}, beyond {dtype.name}'s range "
                             f"(the dtype computed in), where it would be +inf: a mask value "
                             f"must be finite there, or -inf to hide the key")
    return converted


def alignment_offset(causal_alignment: object, L: int, S: int) -> int:
    """The k of i' = i + k that causal_alignment stands for."""
    flag = isinstance(causal_alignment, (bool, np.bool_))  # an int to Python, not here
    if isinstance(causal_alignment, numbers.Integral) and not flag:
        k = int(causal_alignment)
        if abs(k) >= 2**53:
            raise ValueError(f"causal_alignment as an offset must be below 2**53 in magnitude, "
                             f"got {k}")
        return k
    if causal_alignment == "upper_left":
        return 0
    if causal_alignment == "lower_right":
        return S - L
    raise ValueError(f"causal_alignment must be 'upper_left', 'lower_right' or an int offset, "
                     f"got {causal_alignment!r}")


INT32_MAX = int(np.iinfo(np.int32).max)  # the largest block id of the kernels' tables


def cu_seqlens(x: object, name: str, total: int) -> NDArray[np.int64]:
    """Cumulative lengths of B sequences (B + 1,) int32 or int64, starting
    at 0, never decreasing, ending at total: as contiguous int64."""
    a = require_array(x, name, "np.int32")
    if a.dtype not in (np.int32, np.int64):
        raise TypeError(f"{name} has dtype {a.dtype}; expected int32 or int64")
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name} has shape {shape_str(a.shape)}; expected (B + 1,)")
    c = contiguous(a, np.int64)
    if c[0] != 0 or c[-1] != total or (c[1:] < c[:-1]).any():
        down = np.flatnonzero(c[1:] < c[:-1])  # (a second pass only on the way to the error)
        where = (f"{name}[0] = {c[0]}" if c[0] != 0 else
                 f"{name}[{down[0] + 1}] = {c[down[0] + 1]} < {name}[{down[0]}] = {c[down[0]]}"
                 if down.size else f"{name}[-1] = {c[-1]}")
        raise ValueError(f"{name} must start at 0, never decrease and end at the total "
                         f"length {total}; got {where} ({c.shape[0]} values)")
    return c


def check_head_groups(Hq: int, Hkv: int) -> None:
    """ValueError unless the Hq query heads share the Hkv key/value heads in
    equal groups (grouped-query attention; no heads at all is empty)."""
    if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv):
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) "
                         "for grouped-query attention")
