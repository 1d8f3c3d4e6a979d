"""A reference model of the block manager, written for obviousness, not speed.

It names cached content by the *whole token prefix* a block ends (a tuple), not by a hash,
so it shares no hashing code and no data structure with ``atom_core.cache.block_manager``.
It follows the same documented policy, so block tables can be compared id for id:

* the free list is one Python list; blocks are handed out from its front;
* a freed block that holds published content goes to the back, one without to the front;
* a sequence's blocks are freed last block first;
* a prompt is served from the cache block by block from its start while the prefix is
  published somewhere, never including the block that holds the last prompt token;
* publishing a prefix that some block already holds leaves the new block without content;
* a reset of the prefix cache is refused while any sequence holds blocks; otherwise every block
  loses its content and the free list keeps its order.
"""
from __future__ import annotations


class AllocatorModel:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_list: list[int] = list(range(num_blocks))
        self.refs: dict[int, int] = {b: 0 for b in range(num_blocks)}
        # block -> the full token prefix (tuple) whose last block it holds, once published
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.tables: dict[object, list[int]] = {}
        # seq -> how many leading blocks are already counted as computed (hit or published)
        self.known_blocks: dict[object, int] = {}
        self.queries = 0
        self.hits = 0

    # -------------------------------------------------------------- helpers

    def _holder_of(self, prefix: tuple[int, ...]) -> int | None:
        for block, held in self.prefix_of.items():
            if held == prefix:
                return block
        return None

    def _take_new(self) -> int:
        block = self.free_list.pop(0)
        self.prefix_of.pop(block, None)
        self.refs[block] = 1
        return block

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    # -------------------------------------------------------------- operations

    def allocate(self, seq, prompt: list[int]) -> int | None:
        bs = self.block_size
        blocks_needed = (len(prompt) + bs - 1) // bs
        servable = (len(prompt) - 1) // bs if self.enable_prefix_caching else 0
        served: list[int] = []
        for i in range(servable):
            block = self._holder_of(tuple(prompt[: (i + 1) * bs]))
            if block is None:
                break
            served.append(block)
        free_served = [b for b in served if self.refs[b] == 0]
        if blocks_needed - len(served) > len(self.free_list) - len(free_served):
            return None
        for block in served:
            if block in self.free_list:
                self.free_list.remove(block)
            self.refs[block] += 1
        table = served + [self._take_new() for _ in range(blocks_needed - len(served))]
        self.tables[seq] = table
        self.known_blocks[seq] = len(served)
        self.queries += servable
        self.hits += len(served)
        return len(served) * bs

    def append_slots(self, seq, num_tokens_total: int) -> bool:
        table = self.tables[seq]
        extra = (num_tokens_total + self.block_size - 1) // self.block_size - len(table)
        if extra > len(self.free_list):
            return False
        for _ in range(max(extra, 0)):
            table.append(self._take_new())
        return True

    def publish(self, seq, tokens: list[int], num_computed: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table = self.tables[seq]
        full = num_computed // bs
        for i in range(self.known_blocks[seq], full):
            prefix = tuple(tokens[: (i + 1) * bs])
            if self._holder_of(prefix) is None:
                self.prefix_of[table[i]] = prefix
        self.known_blocks[seq] = max(self.known_blocks[seq], full)

    def free(self, seq) -> None:
        table = self.tables.pop(seq)
        del self.known_blocks[seq]
        for block in table[::-1]:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.prefix_of:
                    self.free_list.append(block)
                else:
                    self.free_list.insert(0, block)

    def reset_prefix_cache(self) -> bool:
        if self.tables:
            return False
        self.prefix_of.clear()
        return True
