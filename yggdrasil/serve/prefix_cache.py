"""The pool's prefix cache: full blocks of K/V kept by the tokens they hold, so a request whose
prompt begins like an earlier one's (a system prompt, a growing conversation, an agent loop)
takes those blocks instead of prefilling them again.

A block is keyed by its tokens and its predecessor's key (a chain from position 0), so a key
names one exact prefix; lookups compare the tokens themselves, never a hash alone. Blocks
requests hold are shared read-only (a request writes only past the full blocks it took);
a cached block nobody holds stays in the pool as an idle block, reusable at no cost until the
pool needs the room, when the least recently used idle block is evicted first.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class BlockKey:
    parent: int  # the predecessor block's entry id (-1: the first block)
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._entries: dict[BlockKey, tuple[int, int]] = {}  # key -> (entry id, block)
        self._by_block: dict[int, tuple[BlockKey, int]] = {}  # block -> (key, entry id)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._next_id = 0
        self.hits = self.lookups = self.evictions = 0

    def __len__(self) -> int:
        return len(self._by_block)

    @property
    def idle(self) -> int:
        """Cached blocks no request holds (free for the pool's use)."""
        return len(self._idle)

    def holds(self, block: int) -> bool:
        return block in self._by_block

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of tokens, whole blocks only."""
        self.lookups += 1
        blocks, parent, size = [], -1, self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            entry = self._entries.get(BlockKey(parent, tuple(tokens[start:start + size])))
            if entry is None:
                break
            parent, block = entry
            blocks.append(block)
        self.hits += bool(blocks)
        return blocks

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Remember blocks[i] as holding tokens[i * size:(i + 1) * size], for every whole block
        of tokens (a prefix already cached under other blocks keeps its blocks)."""
        parent, size = -1, self.block_size
        for i in range(min(len(tokens) // size, len(blocks))):
            key = BlockKey(parent, tuple(tokens[i * size:(i + 1) * size]))
            entry = self._entries.get(key)
            if entry is None:
                if blocks[i] in self._by_block:  # the block holds another prefix: nothing past it chains
                    return
                entry = (self._next_id, blocks[i])
                self._next_id += 1
                self._entries[key] = entry
                self._by_block[blocks[i]] = (key, entry[0])
            parent = entry[0]

    def release(self, block: int) -> None:
        """No request holds this cached block any more: it turns idle (most recently used)."""
        self._idle[block] = None
        self._idle.move_to_end(block)

    def take(self, block: int) -> None:
        """A request holds this cached block again."""
        self._idle.pop(block, None)

    def evict(self) -> int:
        """Forget the least recently used idle block and hand it back for reuse."""
        block, _ = self._idle.popitem(last=False)
        key, _ = self._by_block.pop(block)
        del self._entries[key]
        self.evictions += 1
        return block
