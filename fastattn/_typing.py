"""Type aliases of the public signatures (for mypy and readers; nothing
here is checked at run time, where fastattn._checks does the checking)."""
from typing import Any, Literal, TypeVar, Union

import numpy as np
from numpy.typing import DTypeLike, NDArray

__all__ = ["Float", "Scalar", "FloatArray", "MaskArray", "Alignment", "Result", "DTypeLike",
           "NDArray"]

# The dtype of a call's arrays, one for all of them: float32 or float64 at
# run time (anything else is a TypeError).  Bound to floating rather than
# constrained to the two, because NumPy's stubs give floating[Any] to arrays
# whose dtype is chosen at run time (a module's output, a cache's buffers).
Float = TypeVar("Float", bound=np.floating[Any])
# Any dtype (split_heads, a view).
Scalar = TypeVar("Scalar", bound=np.generic)
FloatArray = Union[NDArray[np.float32], NDArray[np.float64]]
# bool (True = may attend, or True = ignore in nn.MultiheadAttention's
# masks) or any floating dtype, added to the scores.
MaskArray = Union[NDArray[np.bool_], NDArray[np.floating[Any]]]
# where query i sits among the keys: a name, or the offset k of i' = i + k
Alignment = Union[Literal["upper_left", "lower_right"], int]
# the output; with the weights and/or the log-sum-exp when asked for
Result = Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]],
               tuple[NDArray[Float], NDArray[Float], NDArray[Float]]]
