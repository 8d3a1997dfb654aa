"""CPU tensors seen as NumPy arrays and back, without copies: what the
integrations hand fastattn's kernels and return to torch."""
from __future__ import annotations

import numpy as np
import torch

try:  # NumPy's bfloat16 (optional: without it bfloat16 tensors cannot be viewed)
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None

HALF = (torch.float16, torch.bfloat16)


def numpy_of(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy); bfloat16 as ml_dtypes.bfloat16."""
    t = t.detach() if t.requires_grad else t
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: the same bits seen as ml_dtypes'
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def real_of(t: torch.Tensor) -> np.ndarray:
    """A mask, bias or sink tensor for NumPy: float32 when 16-bit (additive masks and
    biases as fastattn computes them), else a view."""
    return numpy_of(t.float() if t.dtype in HALF else t)


def tensor_of(a: np.ndarray) -> torch.Tensor:
    """The tensor on a NumPy array's memory (no copy); ml_dtypes.bfloat16 as torch.bfloat16."""
    if ml_dtypes is not None and a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
