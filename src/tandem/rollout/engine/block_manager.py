"""Paged KV blocks and the prefix cache.

A block holds `block_size` consecutive tokens of one sequence. A full block is keyed by a hash
chain over its tokens and all tokens before it, so two sequences with the same prefix share the
blocks of that prefix. Blocks no sequence references stay cached until evicted (LRU).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from tandem.rollout.engine.sequence import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its tokens plus the key of the block before it."""
    return hash((parent, tokens))


class BlockManager:
    """Owns block ids: reference counts, free list, hash -> block map, LRU of cached blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reset(num_blocks)

    def reset(self, num_blocks: int) -> None:
        """Forget every block (used when the KV memory is freed or re-allocated)."""
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # unreferenced, not cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; oldest first
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its block table covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
            self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to cover num_tokens; False (and no change) if blocks lack."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take() for _ in range(needed))
        return True

    def find_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """Cached (block, hash) pairs for seq's leading full blocks. At least one token is left
        to compute, since the next token's logits come from the last token's forward."""
        if not self.enable_prefix_caching:
            return []
        found = []
        parent = None
        size = self.block_size
        for index in range((seq.num_tokens - 1) // size):
            tokens = seq.block_key(index, size)
            key = chain_hash(parent, tokens)
            block = self.hash_to_block.get(key)
            if block is None or self.block_tokens[block] != tokens:
                break
            found.append((block, key))
            parent = key
        return found

    def can_admit(self, seq: Sequence, prefix: list[tuple[int, int]], num_tokens: int) -> bool:
        """Whether seq, sharing `prefix`, can get blocks for num_tokens tokens."""
        unreferenced = sum(1 for block, _ in prefix if self.ref_count[block] == 0)
        needed = max(0, -(-num_tokens // self.block_size) - len(prefix))
        return unreferenced + needed <= self.num_free_blocks

    def share_prefix(self, seq: Sequence, prefix: list[tuple[int, int]]) -> None:
        """Put the cached prefix blocks at the start of seq's (empty) block table."""
        for block, key in prefix:
            if self.ref_count[block] == 0:
                del self.evictable[block]
            self.ref_count[block] += 1
            seq.block_table.append(block)
        seq.num_hashed_blocks = len(prefix)
        seq.last_block_hash = prefix[-1][1] if prefix else None
        seq.num_computed_tokens = len(prefix) * self.block_size

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Key the blocks of seq that the first num_tokens tokens fill, so others can share them.
        Called when those tokens are scheduled: a sequence sharing them in the same step reads
        them after they are written, since every layer writes the KV before attending."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for index in range(seq.num_hashed_blocks, num_tokens // size):
            tokens = seq.block_key(index, size)
            key = chain_hash(seq.last_block_hash, tokens)
            block = seq.block_table[index]
            if key not in self.hash_to_block:  # else an equal block is cached already: keep that
                self.hash_to_block[key] = block
                self.block_hash[block] = key
                self.block_tokens[block] = tokens
            seq.num_hashed_blocks = index + 1
            seq.last_block_hash = key

    def release(self, seq: Sequence) -> None:
        """Drop seq's references; its cached blocks become evictable, tail blocks first."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None
        seq.num_computed_tokens = 0

    def clear_prefix_cache(self) -> None:
        """Un-key every block: nothing computed so far can be matched again. Blocks in use stay
        with their sequences; unreferenced cached blocks return to the free list."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        self.free.extend(self.evictable)
        self.evictable.clear()
