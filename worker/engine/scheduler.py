"""Continuous batching: which sequences run this step, with how many tokens each (pure CPU).

Every step has a token budget (``max_batch_tokens``) and a cap on running sequences
(``max_num_seqs``). The scheduler fills the budget in this order:

1. running sequences that are decoding (one token each), oldest first;
2. running sequences still prefilling (the rest of a chunked prompt), oldest first;
3. waiting sequences, first come first served; a prompt larger than the budget left is cut
   into chunks (chunked prefill) unless that is off. Nothing jumps the queue: when the head of
   the waiting queue does not fit, nothing behind it is admitted.

Prefill and decode tokens share one forward. When a running sequence needs a KV block and
none is free, the latest-arrived running sequence is preempted by recompute: its blocks and
state slot are freed, it goes back to the waiting queue in arrival order (so in front of every
request that never ran), and later prefills its prompt plus the tokens it has generated so
far. Oldest requests therefore always make progress. No new sequence is admitted in a step
that preempted.

``num_lookahead_tokens`` reserves K/V slots for k extra tokens of every sequence that samples
this step: a speculative step feeds drafts after the last known token and needs their slots.

Prefix caching (the block manager's cache): a sequence admitted from the waiting queue (new, or
preempted and now recomputed, which may find its own old blocks) starts its table with the cached
blocks of its longest cached prefix and its prefill after them; the admission counts the tokens
looked up and found. After each step the sequences' newly settled full blocks are cached.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .block_manager import BlockManager
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: feed ``token_ids`` at positions ``start ..``.

    ``num_logits`` trailing rows get logits: 1 when the step reaches the sequence's last known
    token (it samples), 0 for a prefill chunk that does not (a speculative verify asks for more, and
    so does a prompt chunk of a request with ``prompt_logprobs``: all its rows). A sequence samples
    when the chunk reaches its last known token (``context_len`` = its token count).
    """

    seq_id: int
    token_ids: list[int]
    start: int  # position of token_ids[0] = tokens already in the cache
    block_table: list[int]
    num_logits: int
    state_slot: int | None = None
    # The sequence was admitted this step (new or recomputed): its cache starts empty, or with a
    # prefix hit's cached blocks before ``start``.
    admitted: bool = False
    # RoPE positions when not start.. (a draft tree: siblings share a depth); K/V slots stay start..
    position_ids: tuple[int, ...] | None = None
    # A draft tree over token_ids: each token's parent index (-1 for the first); each token then
    # attends to the cached tokens, its ancestors and itself instead of causally. None = causal.
    tree_parents: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache after this step."""
        return self.start + len(self.token_ids)

    @property
    def rope_positions(self) -> list[int]:
        if self.position_ids is not None:
            return list(self.position_ids)
        return list(range(self.start, self.start + len(self.token_ids)))

    @property
    def fresh(self) -> bool:
        """The sequence starts from an empty cache (and an empty recurrent state) this step."""
        return self.start == 0


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    preempted: list[int] = field(default_factory=list)  # seq ids preempted while planning it

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int  # since start
    prefix_caching: bool = False  # whether admissions look up cached prefixes (off by config or for recurrent models)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission, since start
    prefix_cache_hits: int = 0  # of them, tokens found (their prefill skipped)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []  # in arrival order
        self.running: list[Sequence] = []  # in arrival order
        self._seqs: dict[int, Sequence] = {}
        self._free_state_slots: list[int] = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- queue --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if self.waiting and seq.arrival < self.waiting[-1].arrival:
            raise ValueError("sequences must be added in arrival (seq_id) order")
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def get(self, seq_id: int) -> Sequence:
        return self._seqs[seq_id]

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.blocks.num_free_blocks,
                              self.blocks.num_blocks, self.num_preemptions, self.blocks.cache.enabled,
                              self.prefix_cache_queries, self.prefix_cache_hits)

    # --- planning -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Plan one step, reserving the K/V slots it writes (and preempting if it must)."""
        budget = self.config.max_batch_tokens
        planned: dict[int, ScheduledSeq] = {}
        preempted: list[int] = []
        # A sequence whose last allowed token is still a placeholder (an overlapped step in flight) waits
        # for it: that token finishes it.
        decoding = [s for s in self.running if s.num_uncomputed <= 1 and s.num_output_tokens < s.params.max_tokens]
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            total = seq.num_computed + n + self._lookahead(seq, n)
            while not self._can_reserve(seq, total):
                victim = self.running[-1]  # latest arrival
                self._preempt(victim)
                preempted.append(victim.seq_id)
                dropped = planned.pop(victim.seq_id, None)
                budget += dropped.num_tokens if dropped else 0
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.blocks.reserve(seq.seq_id, total)
            planned[seq.seq_id] = self._plan(seq, n)
            budget -= n
        if not preempted:
            budget = self._admit(budget, planned)
        ordered = sorted(planned.values(), key=lambda s: s.seq_id)
        return ScheduledBatch(seqs=ordered, preempted=preempted)

    def _admit(self, budget: int, planned: dict[int, ScheduledSeq]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.blocks.match(seq)
            n = uncomputed = seq.num_tokens - hit.num_tokens
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            total = hit.num_tokens + n + (self.config.num_lookahead_tokens if n == uncomputed else 0)
            if not self.blocks.can_allocate(total, hit):
                break
            self.waiting.pop(0)
            self.blocks.allocate(seq.seq_id, total, hit)
            seq.num_computed = hit.num_tokens
            self.prefix_cache_queries += hit.num_queried
            self.prefix_cache_hits += hit.num_tokens
            seq.status = SequenceStatus.RUNNING
            seq.state_slot = self._free_state_slots.pop()
            bisect.insort(self.running, seq, key=_arrival)
            planned[seq.seq_id] = replace(self._plan(seq, n), admitted=True)
            budget -= n
        return budget

    def _lookahead(self, seq: Sequence, n: int) -> int:
        return self.config.num_lookahead_tokens if n == seq.num_uncomputed else 0

    def _can_reserve(self, seq: Sequence, total: int) -> bool:
        return self.blocks.blocks_needed(seq.seq_id, total) <= self.blocks.num_free_blocks

    def _plan(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed
        samples = n == seq.num_uncomputed
        # prompt_logprobs: every row of a chunk that predicts prompt tokens gets logits too
        scores = seq.params.prompt_logprobs is not None and start + 1 < seq.num_prompt_tokens
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids(start, start + n),
            start=start,
            block_table=self.blocks.table(seq.seq_id),
            num_logits=n if scores else 1 if samples else 0,
            state_slot=seq.state_slot,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_arrival)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        if seq.state_slot is not None:
            self._free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    # --- results ------------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, sampled: dict[int, list[int]],
               settled: Mapping[int, int] | None = None) -> None:
        """Record a finished step: its tokens are in the cache, ``sampled`` tokens are appended.

        After sampling, everything but the last known token is computed (for a speculative
        verify that keeps only the accepted drafts, the rejected drafts' K/V is dropped).
        ``settled``: per sequence, the tokens whose K/V is final in every cache (with a draft
        model, in the draft's cache too); default (None) its computed tokens. Full blocks within
        them are cached.
        """
        for entry in batch.seqs:
            seq = self._seqs.get(entry.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted since it was scheduled
            tokens = sampled.get(entry.seq_id, [])
            seq.output_ids.extend(tokens)
            seq.num_computed = entry.context_len if not tokens else min(entry.context_len, seq.num_tokens - 1)
            final = seq.num_computed if settled is None else min(seq.num_computed, settled.get(seq.seq_id, 0))
            self.blocks.cache_blocks(seq.seq_id, seq, final)

    def settle(self, seq_id: int, num_settled: int) -> None:
        """More of a running sequence's tokens are final (an overlapped step's tokens read back): cache
        the full blocks within them and its computed tokens."""
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.status is SequenceStatus.RUNNING:
            self.blocks.cache_blocks(seq_id, seq, min(seq.num_computed, num_settled))

    def may_admit(self) -> bool:
        """A waiting sequence could be admitted by the next ``schedule`` (one waits and a running slot is free)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def is_running(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.status is SequenceStatus.RUNNING

    def reserve_ahead(self, seq_id: int, total: int) -> list[int] | None:
        """A running sequence's block table made to hold ``total`` slots from the free blocks, preempting nothing
        (a speculative round launched before the last is read back) -> its table, or None (nothing reserved)
        where it is not running or too few blocks are free."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.status is not SequenceStatus.RUNNING or not self._can_reserve(seq, total):
            return None
        self.blocks.reserve(seq_id, total)
        return self.blocks.table(seq_id)

    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """End a sequence (running or waiting) and free what it holds; None if unknown."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return seq
