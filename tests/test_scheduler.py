"""Continuous-batching scheduler, driven by a simulated model over a simulated paged cache.

The simulated model writes each fed token into its cache slot and computes the next token
from what it *reads back* from the cache at every context position, so a wrong block table,
a stale block after preemption or a wrong position would change the output, exactly as it
would with a real model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from fusedserve.worker.engine.block_manager import BlockManager
from fusedserve.worker.engine.prefix_cache import PrefixCache
from fusedserve.worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from fusedserve.worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

VOCAB = 97


def next_token(context: list[int]) -> int:
    h = len(context)
    for i, t in enumerate(context):
        h = (h * 31 + t * (i + 7)) % 1_000_003
    return h % VOCAB


@dataclass
class Sim:
    sched: Scheduler
    cache: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # slot -> (seq, pos, token)
    steps: int = 0
    max_step_tokens: int = 0

    def run_step(self) -> ScheduledBatch:
        s = self.sched
        running_before = sorted(q.seq_id for q in s.running)
        batch = s.schedule()
        self.steps += 1
        cfg = s.config
        # Step-level invariants.
        assert batch.num_tokens <= cfg.max_batch_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert batch.preempted == sorted(running_before, reverse=True)[: len(batch.preempted)]
        assert [q.seq_id for q in s.waiting] == sorted(q.seq_id for q in s.waiting)
        assert [q.seq_id for q in s.running] == sorted(q.seq_id for q in s.running)
        slots = [q.state_slot for q in s.running]
        assert None not in slots and len(set(slots)) == len(slots)
        if batch.preempted:
            assert all(e.seq_id in running_before for e in batch.seqs), "admitted in a preempting step"
        self.max_step_tokens = max(self.max_step_tokens, batch.num_tokens)
        bs = s.blocks.block_size
        sampled: dict[int, list[int]] = {}
        for e in batch.seqs:
            seq = s.get(e.seq_id)
            assert e.state_slot == seq.state_slot
            assert e.fresh == (e.start == 0)
            assert s.blocks.num_slots(e.seq_id) >= e.context_len + (
                cfg.num_lookahead_tokens if e.num_logits else 0)
            for pos, tok in zip(e.rope_positions, e.token_ids):
                self.cache[e.block_table[pos // bs] * bs + pos % bs] = (e.seq_id, pos, tok)
            context = []
            for pos in range(e.context_len):
                owner, p, tok = self.cache[e.block_table[pos // bs] * bs + pos % bs]
                assert (owner, p) == (e.seq_id, pos), "read another sequence's K/V"
                context.append(tok)
            assert context == seq.token_ids(0, e.context_len)
            if e.num_logits:
                sampled[e.seq_id] = [next_token(context)]
        s.update(batch, sampled)
        for sid in sampled:
            seq = s.get(sid)
            if seq.num_output_tokens >= seq.params.max_tokens:
                s.finish(sid, FinishReason.LENGTH)
        return batch

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished():
            self.run_step()
            assert self.steps < max_steps, "no progress"


def make_sched(num_blocks: int = 64, block_size: int = 4, watermark: float = 0.0, **cfg: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, watermark))  # type: ignore[arg-type]


def workload(n: int, seed: int, max_len: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(1, max_len // 2)
        out.append(([rng.randrange(VOCAB) for _ in range(plen)], rng.randint(1, max_len - plen)))
    return out


def run_alone(prompt: list[int], max_tokens: int) -> list[int]:
    s = make_sched(num_blocks=64)
    seq = Sequence(0, "r", list(prompt), SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    Sim(s).run()
    return seq.output_ids


@pytest.mark.parametrize("chunked,max_batch_tokens,lookahead,watermark", [
    (True, 16, 0, 0.0),
    (True, 7, 2, 0.0),
    (False, 64, 0, 0.1),
    (True, 256, 1, 0.05),
])
def test_many_sequences_under_preemption_match_running_alone(
        chunked: bool, max_batch_tokens: int, lookahead: int, watermark: float) -> None:
    jobs = workload(24, seed=max_batch_tokens, max_len=40)
    sched = make_sched(num_blocks=16, block_size=4, watermark=watermark, max_num_seqs=8,
                       max_batch_tokens=max_batch_tokens, enable_chunked_prefill=chunked,
                       num_lookahead_tokens=lookahead)
    seqs = [Sequence(i, f"r{i}", list(p), SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(jobs)]
    for seq in seqs:
        sched.add(seq)
    sim = Sim(sched)
    sim.run()
    assert sched.num_preemptions > 0, "the cache was meant to be too small"
    for seq, (prompt, max_tokens) in zip(seqs, jobs):
        assert seq.output_ids == run_alone(prompt, max_tokens), f"sequence {seq.seq_id}"
        assert seq.status is SequenceStatus.FINISHED
    assert sched.blocks.num_free_blocks == 16
    assert sorted(sched._free_state_slots) == list(range(8))
    assert not sched.running and not sched.waiting


def test_decodes_first_then_prefill_chunks_then_waiting() -> None:
    s = make_sched(max_batch_tokens=8)
    s.add(Sequence(0, "a", [1, 2, 3], SamplingParams(max_tokens=10)))
    s.add(Sequence(1, "b", list(range(20)), SamplingParams(max_tokens=10)))
    s.add(Sequence(2, "c", [5], SamplingParams(max_tokens=10)))
    b1 = s.schedule()
    assert [(e.seq_id, e.num_tokens, e.num_logits) for e in b1.seqs] == [(0, 3, 1), (1, 5, 0)]
    s.update(b1, {0: [9]})
    b2 = s.schedule()  # a decodes (1), b continues its prompt (7), c must wait
    assert [(e.seq_id, e.start, e.num_tokens) for e in b2.seqs] == [(0, 3, 1), (1, 5, 7)]
    assert [q.seq_id for q in s.waiting] == [2]
    s.update(b2, {0: [4]})
    b3 = s.schedule()  # b's last 8 tokens: budget after a's decode is 7, so 7 more
    assert [(e.seq_id, e.num_tokens, e.num_logits) for e in b3.seqs] == [(0, 1, 1), (1, 7, 0)]
    s.update(b3, {0: [4]})
    b4 = s.schedule()
    assert [(e.seq_id, e.num_tokens, e.num_logits) for e in b4.seqs] == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = make_sched(max_batch_tokens=10, enable_chunked_prefill=False)
    s.add(Sequence(0, "a", [1] * 6, SamplingParams()))
    s.add(Sequence(1, "b", [1] * 6, SamplingParams()))
    b = s.schedule()
    assert [(e.seq_id, e.num_tokens) for e in b.seqs] == [(0, 6)]
    s.update(b, {0: [1]})
    b = s.schedule()
    assert [(e.seq_id, e.num_tokens) for e in b.seqs] == [(0, 1), (1, 6)]


def test_waiting_queue_is_first_come_first_served() -> None:
    s = make_sched(num_blocks=4, block_size=4)  # 16 slots
    s.add(Sequence(0, "a", [1] * 10, SamplingParams()))
    s.add(Sequence(1, "b", [1] * 10, SamplingParams()))  # does not fit next to a
    s.add(Sequence(2, "c", [1] * 2, SamplingParams()))  # would fit, but must not jump the queue
    b = s.schedule()
    assert [e.seq_id for e in b.seqs] == [0]
    assert [q.seq_id for q in s.waiting] == [1, 2]


def test_max_num_seqs_caps_running() -> None:
    s = make_sched(max_num_seqs=2)
    for i in range(4):
        s.add(Sequence(i, f"r{i}", [1, 2], SamplingParams()))
    b = s.schedule()
    assert [e.seq_id for e in b.seqs] == [0, 1] and len(s.waiting) == 2


def test_preempted_sequence_recomputes_prompt_and_outputs_first_in_line() -> None:
    s = make_sched(num_blocks=4, block_size=2)  # 8 slots
    s.add(Sequence(0, "a", [1, 2], SamplingParams(max_tokens=4)))
    s.add(Sequence(1, "b", [3, 4], SamplingParams(max_tokens=4)))
    s.add(Sequence(2, "c", [5], SamplingParams(max_tokens=4)))
    b = s.schedule()
    assert [e.seq_id for e in b.seqs] == [0, 1, 2]
    s.update(b, {0: [7], 1: [8], 2: [9]})
    b = s.schedule()  # a and b need a 2nd block each; only one is free -> c (latest) is preempted
    assert b.preempted == [2] and [e.seq_id for e in b.seqs] == [0, 1]
    victim = s.get(2)
    assert victim.status is SequenceStatus.WAITING and victim.num_computed == 0
    assert victim.state_slot is None and not s.blocks.has(2) and victim.num_preemptions == 1
    assert s.waiting[0] is victim
    # Once room frees up, c re-prefills its prompt and its generated token together.
    s.finish(0, FinishReason.STOP)
    s.finish(1, FinishReason.STOP)
    b = s.schedule()
    [e] = b.seqs
    assert (e.seq_id, e.token_ids, e.start, e.num_logits, e.fresh) == (2, [5, 9], 0, 1, True)


def test_abort_frees_running_and_waiting_sequences() -> None:
    s = make_sched(num_blocks=8, max_num_seqs=1)
    s.add(Sequence(0, "a", [1, 2, 3], SamplingParams()))
    s.add(Sequence(1, "b", [1, 2, 3], SamplingParams()))
    s.schedule()
    assert s.blocks.num_free_blocks == 7
    assert s.finish(1, FinishReason.ABORT).finish_reason is FinishReason.ABORT  # waiting
    seq = s.finish(0, FinishReason.ABORT)  # running
    assert seq is not None and seq.status is SequenceStatus.FINISHED
    assert s.blocks.num_free_blocks == 8 and not s.has_unfinished()
    assert s.finish(0, FinishReason.ABORT) is None
    assert s.stats().kv_usage == 0.0


def test_update_after_a_multi_token_step_leaves_last_token_uncomputed() -> None:
    s = make_sched(num_lookahead_tokens=3)
    s.add(Sequence(0, "a", [1, 2, 3], SamplingParams()))
    b = s.schedule()
    assert s.blocks.num_slots(0) == 3 + 3
    s.update(b, {0: [4]})
    assert s.get(0).num_computed == 3
    b = s.schedule()
    [e] = b.seqs
    assert (e.token_ids, e.start) == ([4], 3)
    # A verify step that accepted two drafts and a bonus token: 3 new tokens, last not in cache.
    s.update(b, {0: [5, 6, 7]})
    seq = s.get(0)
    assert seq.output_ids == [4, 5, 6, 7] and seq.num_computed == 4 and seq.num_uncomputed == 3


def test_config_validation() -> None:
    for bad in ({"max_num_seqs": 0}, {"max_batch_tokens": 0}, {"num_lookahead_tokens": -1}):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)  # type: ignore[arg-type]


# --- prefix caching -----------------------------------------------------------------------------


@dataclass
class SharingSim(Sim):
    """``Sim`` over a cache whose blocks may be shared: a slot is right for a sequence when it holds
    its token at that position *after the same tokens* (K/V depends on every token before it), and
    a step never writes into a block that another sequence's table holds."""

    content: dict[int, tuple[int, ...]] = field(default_factory=dict)  # slot -> tokens [0, pos]

    def run_step(self) -> ScheduledBatch:
        s = self.sched
        batch = s.schedule()
        self.steps += 1
        bs = s.blocks.block_size
        sampled: dict[int, list[int]] = {}
        for e in batch.seqs:
            seq = s.get(e.seq_id)
            others = {b for q in s.running if q.seq_id != e.seq_id for b in s.blocks.table(q.seq_id)}
            for pos in e.rope_positions:
                block = e.block_table[pos // bs]
                assert block not in others, f"sequence {e.seq_id} writes block {block}, which another one holds"
                self.content[block * bs + pos % bs] = tuple(seq.token_ids(0, pos + 1))
            for pos in range(e.context_len):
                got = self.content.get(e.block_table[pos // bs] * bs + pos % bs)
                assert got == tuple(seq.token_ids(0, pos + 1)), f"sequence {e.seq_id} reads a wrong slot at {pos}"
            if e.num_logits:
                sampled[e.seq_id] = [next_token(seq.token_ids(0, e.context_len))]
        s.update(batch, sampled)
        for sid in sampled:
            seq = s.get(sid)
            if seq.num_output_tokens >= seq.params.max_tokens:
                s.finish(sid, FinishReason.LENGTH)
        return batch


def caching_sched(num_blocks: int, block_size: int = 4, lookahead: int = 0, **cfg: object) -> Scheduler:
    blocks = BlockManager(num_blocks, block_size, cache=PrefixCache(block_size, lookahead))
    return Scheduler(SchedulerConfig(**cfg), blocks)  # type: ignore[arg-type]


def shared_workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 23))] for _ in range(3)]
    return [(rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))], rng.randint(1, 12))
            for _ in range(n)]


@pytest.mark.parametrize("chunked,max_batch_tokens,lookahead,num_blocks", [
    (True, 16, 0, 16), (True, 7, 1, 14), (False, 64, 0, 20), (True, 256, 1, 64)])
def test_prefix_sharing_keeps_every_sequence_as_if_alone(chunked: bool, max_batch_tokens: int, lookahead: int,
                                                        num_blocks: int) -> None:
    jobs = shared_workload(30, seed=max_batch_tokens)
    sched = caching_sched(num_blocks, max_num_seqs=6, max_batch_tokens=max_batch_tokens,
                          enable_chunked_prefill=chunked, num_lookahead_tokens=lookahead)
    seqs = [Sequence(i, f"r{i}", list(p), SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(jobs)]
    for seq in seqs:
        sched.add(seq)
    SharingSim(sched).run()
    stats = sched.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= sum(len(p) for p, _ in jobs)
    assert stats.prefix_cache_hits % 4 == 0 and stats.prefix_cache_hits < stats.prefix_cache_queries
    if num_blocks < 20:
        assert stats.num_preemptions > 0, "the cache was meant to be too small"
    for seq, (prompt, max_tokens) in zip(seqs, jobs):
        assert seq.output_ids == run_alone(prompt, max_tokens), f"sequence {seq.seq_id}"
    assert sched.blocks.num_free_blocks == num_blocks and not sched.running


def test_admission_starts_after_the_cached_prefix_and_counts_tokens() -> None:
    s = caching_sched(16, block_size=2)
    s.add(Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
    sim = SharingSim(s)
    sim.run()
    assert s.stats().prefix_cache_queries == 5 and s.stats().prefix_cache_hits == 0
    s.add(Sequence(1, "b", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=2)))
    [e] = s.schedule().seqs
    assert (e.start, e.token_ids, e.admitted, e.fresh) == (4, [5, 6, 7], True, False)
    assert s.stats().prefix_cache_queries == 12 and s.stats().prefix_cache_hits == 4


def test_a_preempted_sequence_finds_its_own_blocks_again() -> None:
    s = caching_sched(4, block_size=2)  # 8 slots
    s.add(Sequence(0, "a", [1, 2], SamplingParams(max_tokens=4)))
    s.add(Sequence(1, "b", [3, 4, 5], SamplingParams(max_tokens=4)))
    b = s.schedule()
    s.update(b, {0: [7], 1: [8]})  # b: 3 computed tokens of 4 -> its first block is cached
    b = s.schedule()
    s.update(b, {0: [9], 1: [6]})
    b = s.schedule()  # a needs a 2nd block: b (latest) is preempted; its blocks stay cached
    assert b.preempted == [1]
    s.finish(0, FinishReason.STOP)
    [e] = s.schedule().seqs
    assert e.seq_id == 1 and e.admitted and e.start == 4 and e.token_ids == [6]
    assert s.stats().prefix_cache_hits == 4
