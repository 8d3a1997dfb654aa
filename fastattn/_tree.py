"""Tree masks of speculative decoding: each sequence's draft tokens may see
the positions before them and, among themselves, their ancestors alone
(SpecInfer, Miao et al. 2024; Medusa; EAGLE-2).  The packed layout is
FlashInfer's ``custom_mask`` with its ``mask_indptr``, over the new tokens
only, as vLLM's tree attention biases them: sequence b's L_b x L_b mask,
row-major, from ``tree_mask_indptr[b]``."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from . import _checks as C
from ._typing import NDArray


class Trees(NamedTuple):
    """Checked tree masks as the kernels read them: the packed masks (bool,
    C-contiguous) and where each sequence's starts (int64, -1: none)."""
    mask: NDArray[np.bool_]
    at: NDArray[np.int64]


def check(tree_mask: object, tree_mask_indptr: object, q_lens: NDArray[np.int64],
          lens: NDArray[np.int64]) -> Optional[Trees]:
    """The tree masks of a ragged call of B sequences with q_lens queries and
    lens keys each, checked; None without them."""
    if tree_mask is None:
        if tree_mask_indptr is not None:
            raise ValueError("tree_mask_indptr was given without tree_mask")
        return None
    mask = C.require_array(tree_mask, "tree_mask", "bool")
    if mask.dtype != np.bool_:
        raise TypeError(f"tree_mask has dtype {mask.dtype}; expected bool (True = may attend)")
    if mask.ndim != 1:
        raise ValueError(f"tree_mask has shape {C.shape_str(mask.shape)}; expected the "
                         "sequences' (L_b, L_b) masks flattened and packed, (sum L_b**2,)")
    squares = q_lens * q_lens
    if tree_mask_indptr is None:
        at = np.concatenate(([0], np.cumsum(squares)))
        if at[-1] != mask.shape[0]:
            raise ValueError(f"tree_mask holds {mask.shape[0]} entries; expected the "
                             f"sequences' (L_b, L_b) masks packed, sum L_b**2 = {at[-1]} "
                             "(tree_mask_indptr gives sequences without a tree)")
    else:
        at = C.cu_seqlens(tree_mask_indptr, "tree_mask_indptr", mask.shape[0])
        if at.shape[0] != q_lens.shape[0] + 1:
            raise ValueError(f"tree_mask_indptr holds {at.shape[0]} values; expected one more "
                             f"than the {q_lens.shape[0]} sequences")
    size = at[1:] - at[:-1]
    # with tree_mask_indptr, a sequence may have no tree (plain attention)
    wrong = np.flatnonzero((size != squares) & ((size != 0) | (tree_mask_indptr is None)))
    if wrong.size:
        b = int(wrong[0])
        raise ValueError(f"sequence {b} has {q_lens[b]} queries, so its tree mask is "
                         f"{q_lens[b]} x {q_lens[b]} = {squares[b]} entries; tree_mask "
                         f"gives it {size[b]} (of {mask.shape[0]})"
                         + ("" if tree_mask_indptr is None else " (0: no tree)"))
    has = size > 0
    short = np.flatnonzero(has & (q_lens > lens))
    if short.size:
        b = int(short[0])
        raise ValueError(f"sequence {b} has a tree of {q_lens[b]} tokens but holds "
                         f"{lens[b]} keys: the tree's tokens are its last positions, whose "
                         "keys and values must be in the cache")
    return Trees(C.contiguous(mask), np.where(has, at[:-1], -1).astype(np.int64))


def no_positions(window_size: object, alibi_slopes: object) -> None:
    """ValueError for a tree with a window or ALiBi: a draft sits at its slot
    (its index among the drafts after the tokens before the tree), not at
    its depth, and those options would count slots."""
    window = window_size is not None and not (isinstance(window_size, (tuple, list))
                                              and tuple(window_size) == (-1, -1))
    if window or alibi_slopes is not None:
        raise ValueError("tree_mask does not go with window_size or alibi_slopes: a draft "
                         "token sits at its slot among the drafts, not at its depth in the "
                         "tree, and a window or ALiBi would count slots (a path's bias or "
                         "window would differ from decoding it token by token)")


def dense(tree: NDArray[Any], S: int) -> NDArray[np.bool_]:
    """An (..., L, L) tree mask as the (..., L, S) bool mask of every key:
    the S - L keys before the tree visible."""
    L = tree.shape[-1]
    full = np.ones(tree.shape[:-1] + (S,), np.bool_)
    full[..., S - L:] = tree
    return full
