"""PagedKVCache's prefix cache: full blocks named by the tokens they hold,
chained with the blocks before them (vLLM's automatic prefix caching), so
that a new sequence whose prompt starts with tokens already cached shares
those blocks instead of computing and storing them again."""
from __future__ import annotations

import collections
import hashlib
from typing import Optional, Sequence

import numpy as np


def chain(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """The name of a block holding tokens after the blocks named parent
    (None: the first block): SHA-256 of the parent's name and the tokens as
    int64, so that two names agree only for the same tokens at the same
    positions (a collision would serve another prompt's keys)."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


class PrefixTable:
    """Which block holds each named full block, and the named blocks no
    sequence holds (idle, oldest first): they keep their contents for a
    later match until their memory is needed (least recently used first)."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def idle(self) -> int:
        """Named blocks that no sequence holds."""
        return len(self._idle)

    def register(self, block: int, name: bytes) -> None:
        """block now holds the full block called name (the first block so
        named keeps the name; a block keeps its first name)."""
        if name not in self._block_of and block not in self._name_of:
            self._block_of[name], self._name_of[block] = block, name

    def lookup(self, name: bytes) -> Optional[int]:
        return self._block_of.get(name)

    def release(self, block: int) -> bool:
        """The last holder of block let it go: True when it is named (it
        waits, idle, for a match), False when it is simply free."""
        if block not in self._name_of:
            return False
        self._idle[block] = None
        return True

    def claim(self, block: int) -> None:
        """An idle block matched: held again."""
        self._idle.pop(block, None)

    def evict(self) -> Optional[int]:
        """The least recently released idle block, its name forgotten; None
        when there is none."""
        if not self._idle:
            return None
        block, _ = self._idle.popitem(last=False)
        self.forget(block)
        return block

    def forget(self, block: int) -> None:
        """block's contents are about to change: its name goes."""
        name = self._name_of.pop(block, None)
        if name is not None:
            del self._block_of[name]
