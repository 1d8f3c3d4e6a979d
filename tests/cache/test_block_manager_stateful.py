"""Stateful property test: BlockManager against the reference model in allocator_model.py.

Sequences go through the life an engine gives them: allocate a prompt (possibly sharing a
prefix with an earlier one), prefill in chunks and publish, decode token by token (growing
the table), get preempted (freed) and re-allocated with everything generated so far, finish.
After every step the real manager must pass check_integrity() and agree with the model on
free blocks, block tables, cached-token counts and hit counters.
"""
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from atom_core.cache.block_manager import BlockManager

from tests.cache.allocator_model import AllocatorModel

# A vocabulary of 3 token ids makes accidental shared prefixes common.
token_ids = st.integers(0, 2)


@dataclass
class Seq:
    tokens: list[int]
    max_len: int  # finished once it holds this many tokens (prompt + max new tokens)
    num_computed: int = 0  # leading tokens whose KV is in the pool
    running: bool = False  # holds blocks


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 16]),
        num_blocks=st.integers(1, 32),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size, num_blocks, enable_prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.model = AllocatorModel(num_blocks, block_size, enable_prefix_caching)
        self.seqs: dict[int, Seq] = {}
        self.past_prompts: list[list[int]] = []
        self.computed_prefixes: list[list[int]] = []  # token lists some step computed KV for
        self.next_id = 0

    # -------------------------------------------------------------- helpers

    def _running(self) -> list[int]:
        return [s for s, seq in self.seqs.items() if seq.running]

    def _pick(self, ids: list[int], index: int) -> int:
        return ids[index % len(ids)]

    def _allocate(self, seq_id: int, tokens: list[int]) -> None:
        got = self.bm.allocate(seq_id, tokens)
        expected = self.model.allocate(seq_id, tokens)
        assert got == expected, f"allocate({tokens}) served {got} cached tokens, model {expected}"
        seq = self.seqs[seq_id]
        if got is not None:
            assert got % self.bm.block_size == 0 and 0 <= got < len(tokens)
            seq.running = True
            seq.num_computed = got

    def _new_seq(self, prompt: list[int]) -> None:
        seq_id = self.next_id
        self.next_id += 1
        self.seqs[seq_id] = Seq(tokens=list(prompt), max_len=len(prompt) + 2 * self.bm.block_size + 1)
        self.past_prompts.append(list(prompt))
        self._allocate(seq_id, prompt)
        if not self.seqs[seq_id].running:
            del self.seqs[seq_id]  # a scheduler would keep it waiting; nothing to free

    # -------------------------------------------------------------- rules

    @rule(
        prompt=st.lists(token_ids, min_size=1, max_size=64),
        num_blocks=st.integers(0, 3),
        tail=st.integers(1, 16),
    )
    def allocate_new(self, prompt, num_blocks, tail):
        # num_blocks full blocks plus 1..block_size tokens.
        self._new_seq(prompt[: num_blocks * self.bm.block_size + min(tail, self.bm.block_size)])

    @precondition(lambda self: self.past_prompts)
    @rule(
        index=st.integers(0, 100),
        keep_blocks=st.integers(0, 4),
        keep_extra=st.integers(0, 15),
        suffix=st.lists(token_ids, min_size=1, max_size=20),
    )
    def allocate_sharing_prefix(self, index, keep_blocks, keep_extra, suffix):
        # Mostly prefixes some step computed (likely cached), else any earlier prompt.
        sources = self.computed_prefixes if index % 4 and self.computed_prefixes else self.past_prompts
        earlier = sources[index % len(sources)]
        keep = keep_blocks * self.bm.block_size + keep_extra % self.bm.block_size
        self._new_seq((earlier[:keep] + suffix)[: 5 * self.bm.block_size])

    def _compute(self, seq_id: int, chunk: int, token: int) -> None:
        """One step of one sequence: a prefill chunk, or one decode token (grows the table)."""
        seq = self.seqs[seq_id]
        if seq.num_computed < len(seq.tokens):
            # Blocks for the whole prompt were reserved at allocate; the step computes a chunk.
            seq.num_computed = min(len(seq.tokens), seq.num_computed + chunk)
        else:
            # The last step sampled `token`; this step computes its KV, so it needs a slot.
            ok = self.bm.append_slots(seq_id, len(seq.tokens) + 1)
            assert ok == self.model.append_slots(seq_id, len(seq.tokens) + 1)
            if not ok:
                return
            seq.tokens.append(token)
            seq.num_computed = len(seq.tokens)
        self.bm.publish(seq_id, seq.tokens, seq.num_computed)
        self.model.publish(seq_id, seq.tokens, seq.num_computed)
        if seq.num_computed >= self.bm.block_size:
            self.computed_prefixes.append(seq.tokens[: seq.num_computed])
        if seq.num_computed >= seq.max_len:
            self._finish(seq_id)

    @precondition(lambda self: any(s.running for s in self.seqs.values()))
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 40), token=token_ids)
    def step_one(self, index, chunk, token):
        self._compute(self._pick(self._running(), index), chunk, token)

    @precondition(lambda self: any(s.running for s in self.seqs.values()))
    @rule(chunk=st.integers(1, 40), tokens=st.lists(token_ids, min_size=1, max_size=8))
    def step_all(self, chunk, tokens):
        for i, seq_id in enumerate(self._running()):
            self._compute(seq_id, chunk, tokens[i % len(tokens)])

    @precondition(lambda self: any(s.running for s in self.seqs.values()))
    @rule(index=st.integers(0, 100))
    def preempt(self, index):
        seq_id = self._pick(self._running(), index)
        self.bm.free(seq_id)
        self.model.free(seq_id)
        self.seqs[seq_id].running = False
        self.seqs[seq_id].num_computed = 0

    @precondition(lambda self: any(not s.running for s in self.seqs.values()))
    @rule(index=st.integers(0, 100))
    def resume_preempted(self, index):
        ids = [s for s, seq in self.seqs.items() if not seq.running]
        seq_id = self._pick(ids, index)
        # Recompute preemption: the prompt is now everything the sequence holds.
        self._allocate(seq_id, self.seqs[seq_id].tokens)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        self._finish(self._pick(list(self.seqs), index))

    @precondition(lambda self: self.seqs)
    @rule()
    def finish_oldest(self):
        # A second way out keeps the pool from filling up for good, so allocations can hit.
        self._finish(min(self.seqs))

    @rule()
    def reset_prefix_cache(self):
        # Refused while sequences hold blocks (then nothing changes), done once none does.
        num_free, num_cached, stats = self.bm.num_free_blocks, self.bm.num_cached_blocks, self.bm.stats
        done = self.bm.reset_prefix_cache()
        assert done == self.model.reset_prefix_cache() == (not self._running())
        assert self.bm.num_free_blocks == num_free and self.bm.stats == stats
        assert self.bm.num_cached_blocks == (0 if done else num_cached)

    @precondition(lambda self: self.seqs)
    @rule()
    def drain_and_reset_prefix_cache(self):
        # A weight update: every sequence leaves (the preempted ones keep their tokens), then the reset,
        # after which no earlier prompt may hit (the model, which has forgotten every prefix, says so).
        for seq_id in self._running():
            self.bm.free(seq_id)
            self.model.free(seq_id)
            self.seqs[seq_id].running = False
            self.seqs[seq_id].num_computed = 0
        assert self.bm.reset_prefix_cache() and self.model.reset_prefix_cache()
        assert self.bm.num_cached_blocks == 0 and self.bm.num_free_blocks == self.bm.num_blocks
        for i, prompt in enumerate(self.past_prompts[-3:]):
            probe = ("probe", i)
            got = self.bm.allocate(probe, prompt)
            assert got == self.model.allocate(probe, prompt) and got in (0, None), f"{prompt} hit {got} tokens"
            if got is not None:
                self.bm.free(probe)
                self.model.free(probe)

    def _finish(self, seq_id: int) -> None:
        if self.seqs.pop(seq_id).running:
            self.bm.free(seq_id)
            self.model.free(seq_id)

    # -------------------------------------------------------------- checks

    @invariant()
    def agrees_with_model(self):
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == self.model.num_free_blocks
        for seq_id in self._running():
            assert self.bm.block_table(seq_id) == self.model.tables[seq_id], f"seq {seq_id}"
        stats = self.bm.stats
        assert (stats.queries, stats.hits) == (self.model.queries, self.model.hits)
        assert stats.hit_tokens == self.model.hits * self.bm.block_size

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq_id in self._running():
            self.bm.free(seq_id)
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == self.bm.num_blocks, "a block leaked"


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_block_manager_matches_model = BlockManagerMachine.TestCase
