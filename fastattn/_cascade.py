"""paged_attention's opt-in cascade (``cascade=True``): the blocks every
sequence of the call holds first (vLLM's common prefix) are attended once
for all the call's queries, as one sequence of all of them, which the block
kernel computes as a matrix product; then each sequence's own keys; the
two merged by their log-sum-exps (vLLM's cascade attention, FlashInfer's
shared-prefix attention).  The merge rounds, so a sequence's last bits
depend on the prefix the batch shares: an opt-in, unlike the exact reads
of shared blocks that every call makes."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import numpy as np

from . import _checks as C
from ._typing import NDArray

Call = Callable[..., Any]


def common_prefix(table: NDArray[np.int32], lens: NDArray[np.int64],
                  q_lens: NDArray[np.int64], block_size: int) -> int:
    """Keys that every sequence with queries holds in the same blocks, in
    whole blocks, and that every one of its queries sees (at most each
    sequence's keys before its queries); 0 with fewer than two such
    sequences."""
    live = np.flatnonzero(q_lens > 0)
    if live.size < 2:
        return 0
    blocks = int((lens[live] - q_lens[live]).min()) // block_size
    if blocks <= 0:
        return 0
    rows = table[live, :blocks]
    same = (rows == rows[0]).all(axis=0)
    return (blocks if same.all() else int(np.argmin(same))) * block_size


def attend(call: Call, query: NDArray[Any], table: NDArray[np.int32], lens: NDArray[np.int64],
           cu_q: NDArray[np.int64], q_lens: NDArray[np.int64], prefix: int, block_size: int,
           lse_wanted: bool, out: Optional[NDArray[Any]], sinks: Optional[NDArray[Any]],
           trees: Any, merge: Call
           ) -> Union[NDArray[Any], tuple[NDArray[Any], NDArray[Any]]]:
    """The cascade of a checked paged call: call(query, table, lens, cu_q,
    q_lens, causal, sinks, trees) runs the ragged kernels with the call's
    other arguments and returns (out, lse); merge is merge_attention."""
    first = int(np.flatnonzero(q_lens > 0)[0])
    n = prefix // block_size
    total_q = query.shape[0]
    # every query over the prefix, one sequence of total_q rows, none hidden
    shared, shared_lse = call(query, C.contiguous(table[first:first + 1, :n]),
                              np.array([prefix], np.int64), np.array([0, total_q], np.int64),
                              np.array([total_q], np.int64), False, sinks, None)
    own, own_lse = call(query, C.contiguous(table[:, n:]), np.maximum(lens - prefix, 0), cu_q,
                        q_lens, None, None, trees)
    merged, lse = merge([shared.transpose(1, 0, 2), own.transpose(1, 0, 2)],
                        [shared_lse, own_lse])
    result = merged.transpose(1, 0, 2)
    if out is not None:
        out[...] = result
        result = out
    return (result, lse) if lse_wanted else result
