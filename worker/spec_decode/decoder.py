"""EAGLE3 speculative decoding in the engine: draft, verify with one target forward, accept.

Per engine step, for every sequence that is decoding (its one new token is its last known
token, with at least one token already in the cache):

1. Draft (leader only, ``Drafter`` over the draft's ``StepExecutor``): the draft's first pass over the positions the target
   computed since the last draft (their aux states were captured by the target's forward; a
   prefilled prompt's first pass warms the draft cache), whose last row gives the first draft
   step; then ``num_steps - 1`` more steps, each feeding the ``topk`` best leaves (a chain:
   the one draft). ``TreeBuilder`` keeps the ``num_draft_tokens - 1`` best candidates.
2. Verify: the sequence's entry in the step's one target forward carries the root and the
   drafts, positions by depth and the tree's parents (a tree mask over its own slots); the
   target's forward returns the aux states of every row beside the logits (``ModelOutput.hidden``).
3. Accept, against the target's ADJUSTED distribution at each node (``TokenSampler``: penalties,
   bias, ``min_tokens`` and the grammar's mask with the history as it would be at that node, then
   temperature, min-p, top-k, top-p; the draft's proposals are not adjusted, which the rules
   allow: a draft the adjusted target gives no mass is rejected): greedy requests exactly (the
   adjusted argmax, ``accept_greedy``); sampled requests by the rejection rule
   (``rejection_sampler``: the standard rule for a chain, whose drafts are sampled from the
   draft's distribution; the target-only rule for a tree, whose candidates are the draft's
   top-k), with the request's own random stream. The accepted nodes' K/V move to the
   sequence's next slots (the runner's ``copy_kv``); their aux rows wait for the next draft.

On one rank (an executor alone, or a group's leader without followers: ``Runner.single_rank``, as ``fusedserve
run`` serves one GPU) the step waits once: a chain's drafts (``_deferred_verify``) and a tree
(``_deferred_tree``: grown on the device, at captured shapes) stay on the device and the verify is
queued right behind the draft's replays with them as its inputs; the drafts, or the trees, are read
back after it with the target's argmax of every row, and a chain's sampled requests whose logits
nothing adjusts with their acceptance, drawn on the device (``accept_chains_sampled``). Where every
sequence of a chain step drafts and no request's logits are adjusted, the next round's chains are
drafted on the device right behind the verify, from the device's own acceptance
(``_acceptance_on_device``, ``Drafter.chain_after``), while the host reads this one back; the next
step takes each where the host accepted as many drafts (``Drafter.settle_ahead``). A greedy round of
that kind at a captured verify (``_greedy_round``) leaves the host no op between the forwards: the
verify's graph computes its argmax, the acceptance and the read-back row of each sequence and stages the
next chain's first pass (``verify_program.py``), which the host replays as staged; the host-op path stays
its reference and runs every other chain round (sampled requests, mixed steps).

Rounds in flight (``step(..., overlap=True)``, the engine's ``overlap_scheduling``: on by default on a GPU):
such a greedy round is left launched, not read back. The engine's next step calls ``advance``, which first
launches the round after it (``_follow``) and only then reads it back and accepts it, so the host commits
round N (acceptance, text, stops) while the GPU runs round N + 1's verify and chain. Round N + 1's verify
replays on the inputs round N's verify program staged (``stage_next_verify``: each root the token after the
drafts the device accepted, rows, slots and context moved on by as many) with the chain drafted behind round
N as its drafts; the host only reserves blocks three verifies ahead and copies the chain in. A round with
sampled requests (each greedy or temperature-only, none adjusted: ``_sampled_round``) goes the same way: its
sampled chains are accepted by the rejection rule on the device, every chain's outcome is made there
(``chain_outcomes``; where every chain samples, the rule's own rows of tokens: no launch more), the staged inputs
are moved from the greedy rule's outcome to the device's and take the next chain (``restage_sampled``; on a GPU
each of these one Triton launch) and the next sampled chain replays on the
staged first pass with the request's numbers (``Drafter.replay_staged_sampled``), drawn from each stream in the
order rounds read one by one draw them. The device's acceptance is the host's by construction (the same drafts,
argmax, rule and numbers); a sequence that stops in round N (EOS, a stop string, its length) or is aborted drops
round N + 1's rows, whose K/V lie past its kept tokens in blocks it frees. A round follows only while no waiting
request could be admitted (none waits, or every running slot is taken: ``Scheduler.may_admit``), every running sequence
is in it, no request asks for logprobs (round N + 1's logits replay over N's), the free blocks hold the
reservation and ``max_len`` leaves room; otherwise the round is read back as it stands and the next step is
scheduled as usual.

A greedy tree round on one rank (``_tree_round``) goes the same way: its verify's graph accepts on the device,
says where the accepted nodes' K/V go (applied right behind it: the host relocates nothing) and stages the
draft's first pass + tree chain, one captured graph, and its own next inputs (``tree_verify_program.py``); the
round after it copies the tree drafted behind it (tokens, RoPE positions, masks) into those inputs and replays
(``_follow_tree``). The host's tree path (``_deferred_tree``: the host accepts and relocates) is its reference and
runs every other tree round (sampled requests, adjusted logits, mixed steps).

Prefill chunks and a prompt's first sample run as without speculation (and capture aux).
Preempted sequences lose their draft state and rebuild it from the recomputed prefill. A
verify's drafts are not counted against ``max_batch_tokens``: a step may feed up to
``num_draft_tokens - 1`` more tokens per decoding sequence than the scheduler planned.

Prefix caching: a sequence admitted with a prefix hit of ``P`` cached tokens starts with the
draft's bases [0, P) already in the draft cache (the same block ids as the target's). The earlier
sequence's first passes wrote them: a block is cached only once its draft K/V is final
(``SpecStep.settled``: the draft's bases), and its key covers the token after it, which the
draft's K/V in its last slot was computed from. The target computes no aux state for the cached
positions and the drafter needs none. A sequence drafts once the target has computed a position
the draft has not (a prompt whose only uncomputed token is its last samples it plainly first).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...models.eagle3 import Eagle3Draft
from ...models.interface import ModelOutput
from ..engine.forward_step import forward_step
from ..engine.request_state import RequestState
from ..engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from ..engine.sequence import SamplingParams, Sequence
from ..engine.token_sampler import Pick, TokenSampler
from ..executor.executor import StepExecutor
from ..executor.host_copy import read_later, to_device
from ..executor.step import SeqRows, Step
from ..executor.step_graphs import StaticInputs
from ..executor.step_shape import StepShape, prefill_shapes
from .config import SpeculativeConfig, SpeculativeConfigError
from .device_tree import DeviceTree
from .draft_model import build_draft, chain_shapes, draft_shapes
from .draft_tree import Acceptance, DraftTree, accept_greedy, relocation, tree_positions
from .drafter import Ahead, Drafter, DraftState, DraftWork, Proposal, draft_temperatures, draws
from .rejection_sampler import (
    Uniforms,
    accept_chains_sampled,
    chain_acceptor,
    chain_outcomes_fn,
    chain_rows,
    verify_chain_sampled,
    verify_tree_sampled,
)
from .stats import SpecDecodeCounters, SpecDecodeStats
from .tree_verify_program import TreeVerifyProgram, apply_moves, tree_stage_kernel
from .verify_program import VerifyProgram, restage_fn, verify_stage_kernel

if TYPE_CHECKING:
    from ..engine.engine import Runner

log = logging.getLogger(__name__)

# A greedy tree round on one rank accepted, its K/V moved and its next tree drafted on the device, in flight where
# the engine overlaps (``_tree_round``); False: the host's tree path (``_deferred_tree``) as before the thirty-third
# session, the A/B (bench/spec_decode_real.py --set worker.spec_decode.decoder.TREE_ROUNDS_ON_DEVICE=False).
TREE_ROUNDS_ON_DEVICE = True


@dataclass(frozen=True)
class SpecStep:
    """A step as run, for ``Engine.commit_step``: verify entries carry their drafts."""

    batch: ScheduledBatch
    seqs: list[Sequence]  # the sequences with logits, in batch order
    picks: list[Pick]
    settled: dict[int, int]  # per sequence of the batch: tokens whose K/V is final in the draft's cache


StateOf = Callable[[Sequence], RequestState]


@dataclass(frozen=True)
class Verified:
    """A step's verify as run: its entries (drafts in), the logits rows, every row's aux states [num_tokens, 3H],
    the proposals by sequence; what was read back already: the raw logits' argmax per row, the sampled chains
    accepted on the device, the device's acceptance counts of the sequences whose next chain was drafted ahead."""

    run: ScheduledBatch
    logits: torch.Tensor
    aux: torch.Tensor
    proposals: dict[int, Proposal]
    argmax: list[int] | None = None
    accepted: dict[int, Acceptance] = field(default_factory=dict)
    drafted: dict[int, int] = field(default_factory=dict)
    moved: bool = False  # the accepted nodes' K/V were moved on the device (a tree round in flight)


@dataclass(frozen=True)
class SampledRows:
    """A chain round's sampled requests as the device takes them, made once for the rounds in flight that follow
    it (the same sequences): their indices in the batch (``indices``, and on the device ``pick`` [S]), each
    chain's first logits row ``first_rows`` [S] (``i * (num_steps + 1)``), their temperatures [S] where every one
    sets nothing but a temperature (the chain rule's fast path), else None, and every request's temperature as
    the draft's sampled chain takes it (``draft_temperatures`` [B]: 0 for a greedy one)."""

    indices: tuple[int, ...]
    pick: torch.Tensor
    first_rows: torch.Tensor
    temperatures: torch.Tensor | None
    draft_temperatures: torch.Tensor


@dataclass(frozen=True)
class RoundInFlight:
    """A greedy chain round launched and not read back (``SpecDecoder._greedy_round``, ``_follow``): its verify
    and the chain drafted behind it are queued; ``read`` waits for its verdict alone. ``batch`` and ``work``: its
    sequences' root entries (None for a round launched before the one ahead of it was read: ``_taken`` makes
    them)."""

    batch: ScheduledBatch | None
    work: list[DraftWork] | None
    shape: StepShape  # the verify's captured shape
    logits: torch.Tensor  # its rows' logits (the static output: the next verify replays over it)
    aux: torch.Tensor  # its rows' aux states [rows, 3H], copied out of the static output
    read: Callable[[], list[Any]]  # its verdict [B, 2q] (drafts, argmax, count), flat
    next_drafts: torch.Tensor | None  # [B, num_steps]: the chain drafted behind it on the device, or None
    covered: tuple[int, ...]  # per sequence, the slots its block table held in the verify's inputs
    tables: tuple[tuple[int, ...], ...] | None = None  # per sequence, the block table it was launched with
    # a round with sampled requests (``_sampled_round``): their indices, accepted by the rejection rule on the device
    sampled: tuple[int, ...] = ()
    next_q: torch.Tensor | None = None  # [B, num_steps, vocab]: the next chain's q (its sampled rows')
    next_uniforms: torch.Tensor | None = None  # [B, num_steps]: the numbers the next chain drew
    counts: torch.Tensor | None = None  # [B]: each sequence's drafts accepted on the device
    tokens: torch.Tensor | None = None  # [B, num_steps + 1]: its accepted drafts, then the token emitted after them
    greedy_counts: torch.Tensor | None = None  # [B]: the greedy rule's counts, which its verify program staged from
    rows: SampledRows | None = None  # its sampled requests on the device
    next_tree: DeviceTree | None = None  # a tree round's: the trees drafted behind it on the device

    @property
    def follows(self) -> bool:
        """The round after it can be launched before it is read back (its next chain or tree is drafted)."""
        return self.next_drafts is not None

    @property
    def is_tree(self) -> bool:
        return self.shape.tail > 0


class SpecDecoder:
    """``target``: the runner of the target's forwards (its executor returns the aux states of
    ``layers`` with every forward); ``draft``: the draft's own executor (leader only)."""

    def __init__(self, config: SpeculativeConfig, target: Runner, draft_model: Eagle3Draft, draft: StepExecutor,
                 tokens: TokenSampler, vocab_size: int) -> None:
        self.config = config
        self.target = target
        self.draft_model = draft_model
        self.draft = draft
        self.tokens = tokens
        self.sampler = sampler = tokens.sampler
        self.layers = target.local.aux_layers
        if not self.layers:
            raise SpeculativeConfigError("the target executor returns no aux states (built without the speculative "
                                         "config)")
        self.counters = SpecDecodeCounters(config.num_steps)
        self._states: dict[int, DraftState] = {}
        self._in_flight: RoundInFlight | None = None
        self._accept_at_temperature = chain_acceptor(target.local.device)
        self._chain_outcomes = chain_outcomes_fn(target.local.device)
        self._restage = restage_fn(target.local.device)
        self.drafter = Drafter(draft, draft_model, sampler, vocab_size, config.num_steps, config.topk,
                               config.verify_tokens)

    @staticmethod
    def load(config: SpeculativeConfig, target_dir: str | Path, target_config: Any, target: Runner,
             tokens: TokenSampler, dtype: torch.dtype) -> SpecDecoder:
        """The draft next to the target's cache (the same block tables and block count)."""
        local = target.local
        if local.state_cache is not None:
            raise SpeculativeConfigError("speculative decoding needs a target without recurrent (Mamba) state: "
                                         "rejected drafts cannot be taken back out of it")
        model, draft = build_draft(config.draft_model, target_dir, target_config, local.kv_cache.num_blocks,
                                   local.kv_cache.block_size, dtype, local.device, local.graph_ready,
                                   local.reserved_blocks, local.kernels)
        if config.topk > model.draft_vocab:
            raise SpeculativeConfigError(f"topk {config.topk} exceeds the draft vocabulary ({model.draft_vocab})")
        log.info("EAGLE3 draft %s: aux layers %s, %d steps, topk %d, %d verified tokens", config.draft_model,
                 local.aux_layers, config.num_steps, config.topk, config.verify_tokens)
        return SpecDecoder(config, target, model, draft, tokens, int(target_config.vocab_size))

    def stats(self) -> SpecDecodeStats:
        return self.counters.snapshot()

    def target_shapes(self, batch_sizes: list[int]) -> list[StepShape]:
        """The verify forwards' shapes: every drafting sequence feeds the root and its drafts
        (a tree with its mask over them)."""
        q = self.config.verify_tokens
        return [StepShape(b, q, 0 if self.config.is_chain else q) for b in batch_sizes]

    def capture_graphs(self, batch_sizes: list[int], max_blocks: int, prefill: list[int] | None = None) -> None:
        """Capture the draft's first pass and steps (once, at start-up; the steps also chained: a greedy
        chain's, a tree's grown on the device), then the target's verify forwards — on one rank with a chain
        with the verify's program after the forward (``verify_program.py``: acceptance on the device, the
        next chain's first pass staged). ``prefill``: prompt lengths whose one-sequence prefill is captured
        too, the target's and the draft's pass over the prompt (``EngineConfig.prefill_graph_tokens``)."""
        lengths = prefill or []
        shapes = draft_shapes(self.draft_model, batch_sizes, self.config.num_steps, self.config.topk)
        shapes += prefill_shapes(lengths, int(self.draft_model.fc.in_features))
        if self.draft.chainable():
            shapes += chain_shapes(self.draft_model, batch_sizes, self.config.num_steps, self.config.topk)
        self.draft.capture(shapes, max_blocks, feed=self.drafter.greedy_tokens, grow=self.drafter.grow_tree,
                           sample=self.drafter.sample_tokens, leaves=self.drafter.first_leaves)
        target = self.target_shapes(batch_sizes) + prefill_shapes(lengths)
        if self.target.single_rank and self.drafter.is_chain:
            program = VerifyProgram(self.sampler.argmax, self._staged, verify_stage_kernel(self.target.local.device))
            self.target.local.capture(target, max_blocks, finish=program)
        elif self.target.single_rank:
            tree = TreeVerifyProgram(self.sampler.argmax, self._tree_staged, self.config.num_steps,
                                     tree_stage_kernel(self.target.local.device))
            self.target.local.capture(target, max_blocks, finish=tree)
        else:
            self.target.capture(target, max_blocks)

    def _staged(self, batch: int) -> StaticInputs | None:
        """The draft's greedy first pass + chain for a verify of ``batch`` (padded) sequences to stage, if it
        is captured at that very batch."""
        staged = self.drafter.first_chain_staged(batch)
        return staged[1] if staged is not None and staged[0].batch == batch else None

    def _tree_staged(self, batch: int) -> StaticInputs | None:
        """The draft's first pass + tree chain for a tree verify of ``batch`` (padded) sequences to stage, if it is
        captured at that very batch."""
        staged = self.drafter.first_tree_staged(batch)
        return staged[1] if staged is not None and staged[0].batch == batch else None

    # --- one engine step ----------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """A round is launched and not yet read back (``advance`` reads it)."""
        return self._in_flight is not None

    def step(self, batch: ScheduledBatch, scheduler: Scheduler, state_of: StateOf, overlap: bool = False
             ) -> SpecStep | None:
        """Draft for the decoding sequences, run the step's target forward, accept and sample. ``overlap``: a
        greedy round that can be followed before it is read back is left in flight instead (None: nothing to
        commit yet; ``advance`` goes on from it)."""
        if self._in_flight is not None:
            raise RuntimeError("a speculative round is in flight: advance() reads it first")
        live = {s.seq_id for s in scheduler.running}
        for seq_id in [s for s in self._states if s not in live]:
            del self._states[seq_id]
        seqs = [scheduler.get(e.seq_id) for e in batch.seqs]
        for e in batch.seqs:
            if e.admitted or e.start == 0:  # a prefix hit's bases are in the draft cache already
                self._states[e.seq_id] = DraftState(num_bases=e.start)
            state = self._states.get(e.seq_id)
            if state is None or state.num_bases + state.num_pending != e.start:
                raise RuntimeError(f"sequence {e.seq_id}: draft state out of step with the target's cache")
        work = [DraftWork(e, s, self._states[e.seq_id], self._draw(state_of(s).generator))
                for e, s in zip(batch.seqs, seqs) if self._drafts(e, self._states[e.seq_id])]
        launched = self._greedy_round(batch, work, state_of) or self._tree_round(batch, work, state_of)
        if launched is None and overlap:
            launched = self._sampled_round(batch, work, state_of)
        if launched is not None and overlap and launched.follows and all(w.seq.params.logprobs is None
                                                                         for w in work):
            self._in_flight = launched  # its logits rows are not read: the next verify may replay over them
            return None
        verified = ((self._verified(launched) if launched is not None else None)
                    or self._deferred_verify(batch, work, state_of) or self._deferred_tree(batch, work))
        if verified is None:
            proposals = dict(zip((w.entry.seq_id for w in work), self.propose(work)))
            entries = [self._verify_entry(e, proposals[e.seq_id].tree) if e.seq_id in proposals else e
                       for e in batch.seqs]
            run = ScheduledBatch(seqs=entries, preempted=batch.preempted)
            out = self.target.run(forward_step(run))
            verified = Verified(run, out.logits, torch.cat(out.hidden, dim=-1), proposals)
        return self._settle(verified, seqs, {w.entry.seq_id: w.draw for w in work}, state_of)

    def _settle(self, verified: Verified, seqs: list[Sequence], draws: dict[int, Uniforms], state_of: StateOf
                ) -> SpecStep:
        """Accept a verified step's drafts and sample its other rows -> the step as ``Engine.commit_step`` takes
        it (sequences finished since it was launched get nothing)."""
        run, entries = verified.run, verified.run.seqs
        results = self._accept(verified, seqs, draws, state_of)
        sampling = [(s, results[i]) for i, (e, s) in enumerate(zip(entries, seqs))
                    if e.num_logits > 0 and i in results]
        settled = {e.seq_id: self._states[e.seq_id].num_bases for e, s in zip(run.seqs, seqs) if not s.is_finished}
        return SpecStep(run, [s for s, _ in sampling], [p for _, p in sampling], settled)

    def advance(self, scheduler: Scheduler, state_of: StateOf, follow: bool, max_len: int) -> SpecStep:
        """Read back the round in flight and accept it, having first launched the round after it where it can
        follow (``follow``: no waiting request could be admitted now; see ``_follow``) -> the round read back, for
        ``Engine.commit_step``; the next is then in flight. Sequences finished meanwhile (a stop, an abort) get
        nothing from it."""
        r, self._in_flight = self._in_flight, None
        assert r is not None and r.work is not None
        nxt = self._follow(r, scheduler, max_len) if follow else None
        verified = self._verified(r)
        seqs = [w.seq for w in r.work]
        done = self._settle(verified, seqs, {w.entry.seq_id: w.draw for w in r.work}, state_of)
        for seq in seqs:
            if seq.is_finished:
                self._states.pop(seq.seq_id, None)
        if nxt is not None:
            self._in_flight = self._taken(nxt, r, done)
        return done

    def _greedy_round(self, batch: ScheduledBatch, work: list[DraftWork], state_of: StateOf) -> RoundInFlight | None:
        """A greedy chain round on one rank, every sequence drafting and no request's logits adjusted, at a
        captured verify, launched: the verify's graph accepts on the device and stages the next chain's first
        pass and its own next inputs (``verify_program.py``); the host replays the verify, queues the read-back
        of its verdict (drafts, argmax, acceptance counts) and replays the staged first pass + chain
        (``Drafter.chain_after_staged``) — no op of the host's between the forwards. ``_verified`` reads it
        back; ``advance`` may first launch the round after it (``_follow``). ``_deferred_verify`` with the
        acceptance and the next chain's inputs made by host ops is its reference (and runs every other chain
        round). None (nothing run) where this does not apply."""
        local = self.target.local
        if not all(w.seq.params.greedy and not self.tokens.adjusts(w.seq, state_of(w.seq)) for w in work):
            return None
        ran = self._chain_verify(batch, work)
        if ran is None:
            return None
        shape, _, _, out, aux, verdict = ran
        read = read_later(verdict.reshape(-1))  # queued behind the verify, before the next chain's replay
        ahead = work[0].state.ahead if self.drafter.chain_after_staged(work, shape.batch) else None
        bs = local.block_size
        return RoundInFlight(batch, work, shape, out.logits, aux.clone(), read,
                             None if ahead is None else ahead.batch,
                             tuple(len(e.block_table) * bs for e in batch.seqs))

    def _tree_round(self, batch: ScheduledBatch, work: list[DraftWork], state_of: StateOf) -> RoundInFlight | None:
        """``_greedy_round`` for a tree: every request greedy with nothing adjusting its logits, every sequence
        drafting, on one rank, at a captured verify with its program (``tree_verify_program.py``). The trees are
        grown on the device (or were drafted ahead behind the last verify), the verify replays on them, its
        program accepts, stages the next first pass and its own next inputs and says where the accepted nodes'
        K/V go, which is applied right behind it (``apply_moves``: the host relocates nothing); the read-back of
        its verdict is queued and the next trees are drafted behind it on the staged first pass
        (``Drafter.tree_after_staged``). ``_deferred_tree`` (the host relocates) stays its reference and runs
        every other tree round on one rank. None (nothing run) where this does not apply."""
        local = self.target.local
        if (not TREE_ROUNDS_ON_DEVICE or not work or not self.target.single_rank or self.drafter.is_chain
                or len(work) != len(batch.seqs)
                or not all(w.seq.params.greedy and not self.tokens.adjusts(w.seq, state_of(w.seq)) for w in work)):
            return None
        step = self._tree_step(work)
        shape = local.graph_shape(step)
        if shape is None or not local.finishes(shape):
            return None
        tree = self.drafter.tree_on_device(work)
        if tree is None:
            return None
        ran = local.run_finished(step, shape=shape, **self._tree_inputs(work, tree))
        assert ran is not None  # finishes(shape) said so
        out, (aux, verdict, moves) = ran
        read = read_later(verdict.reshape(-1))  # queued behind the verify, before the next trees' replay
        apply_moves(local.kv_cache, moves, local.move_kv)
        nxt = self.drafter.tree_after_staged(work, shape.batch)
        bs = local.block_size
        return RoundInFlight(batch, work, shape, out.logits, aux.clone(), read, None if nxt is None else nxt.tokens,
                             tuple(len(e.block_table) * bs for e in batch.seqs), next_tree=nxt)

    def _tree_step(self, work: list[DraftWork]) -> Step:
        """A tree verify's step as the host lays it out where the device supplies its tokens, positions and masks:
        the root at its position, then placeholders (the size alone matters)."""
        n = self.config.verify_tokens
        mask = _layout_mask(n)  # the layout only: the device's masks replace it (nothing built or packed per node)
        return Step(tuple(SeqRows(tuple(w.entry.block_table), (w.entry.token_ids[0],) + (0,) * (n - 1),
                                  (w.entry.start,) + (w.entry.start + 1,) * (n - 1), w.entry.start + n, n, mask)
                          for w in work))

    def _tree_inputs(self, work: list[DraftWork], tree: DeviceTree) -> dict[str, torch.Tensor]:
        """A tree verify's device inputs (``StepExecutor.run``'s): the trees' tokens, their RoPE positions (each
        root's plus the node's depth) and their masks."""
        n = self.config.verify_tokens
        starts = to_device([w.entry.start for w in work], self.target.local.device)
        return {"input_ids": tree.tokens.reshape(-1), "positions": (starts[:, None] + tree.depths).reshape(-1),
                "tail_rows": tree.mask.reshape(len(work) * n, n)}

    def _chain_verify(self, batch: ScheduledBatch, work: list[DraftWork]) -> tuple[
            StepShape, torch.Tensor, torch.Tensor | None, ModelOutput, torch.Tensor, torch.Tensor] | None:
        """A chain round's drafts (``Drafter.chain``) and its verify replayed at a captured shape with the verify's
        program, the roots packed by the host and the drafts on the device, on one rank with every sequence
        drafting -> (the shape, drafts [B, num_steps], their q or None, the verify's output, its aux states, its
        verdict), or None (nothing run) where not."""
        local = self.target.local
        if not work or not self.target.single_rank or not self.drafter.is_chain or len(work) != len(batch.seqs):
            return None
        n = self.config.verify_tokens - 1
        placeholder = [replace(e, token_ids=[*e.token_ids, *[0] * n], num_logits=n + 1) for e in batch.seqs]
        step = forward_step(ScheduledBatch(seqs=placeholder, preempted=batch.preempted))
        shape = local.graph_shape(step)
        if shape is None or not local.finishes(shape):
            return None
        drafts, q = self.drafter.chain(work)  # [B, num_steps] (and the sampled rows' q), on the device
        ran = local.run_finished(step, later_ids=drafts[:, :n], shape=shape)
        assert ran is not None  # finishes(shape) said so
        out, (aux, verdict) = ran
        return shape, drafts, q, out, aux, verdict

    def _sampled_round(self, batch: ScheduledBatch, work: list[DraftWork], state_of: StateOf) -> RoundInFlight | None:
        """``_greedy_round`` for a chain round with sampled requests (each greedy or temperature-only, none
        adjusted): after the verify (its program stages the greedy rule's next inputs) the sampled chains are
        accepted by the rejection rule on the device (``_accept_on_device``), every chain's outcome made on the
        device, and the next chains drafted behind it (``Drafter.chain_after``); its read-back is the verdict
        and the sampled chains' outcomes. ``_follow`` launches the round after it on the verify's staged inputs
        moved to the sampled outcomes. None (nothing run) where this does not apply (every request greedy:
        ``_greedy_round``)."""
        local = self.target.local
        if all(w.seq.params.greedy for w in work) or not all(
                (w.seq.params.greedy or w.seq.params.temperature_only) and not self.tokens.adjusts(w.seq, state_of(w.seq))
                for w in work):
            return None
        ran = self._chain_verify(batch, work)
        if ran is None:
            return None
        shape, drafts, q, out, aux, verdict = ran
        assert q is not None  # a request samples
        n = self.config.verify_tokens - 1
        sampled = tuple(i for i, w in enumerate(work) if not w.seq.params.greedy)
        rows = self._sampled_rows(work, sampled, n)
        outcome = self._sampled_outcomes(work, rows, drafts[:, :n], q[:, :n], out.logits, verdict)
        read = read_later(torch.cat([verdict.reshape(-1), *outcome[:2]]))
        counts, tokens = outcome[2:]
        ahead = self.drafter.chain_after(work, tokens.reshape(-1), aux, counts)
        nxt = [a for w in work if (a := w.state.ahead) is not None] if ahead else []
        next_drafts = nxt[0].batch if len(nxt) == len(work) else None
        next_q = self.drafter.ahead_q(nxt) if next_drafts is not None else None
        bs = local.block_size
        return RoundInFlight(batch, work, shape, out.logits, aux.clone(), read, next_drafts,
                             tuple(len(e.block_table) * bs for e in batch.seqs), None, sampled, next_q, None,
                             counts, tokens, verdict[:, -1].clone(), rows)

    def _sampled_rows(self, work: list[DraftWork], sampled: tuple[int, ...], k: int) -> SampledRows:
        """The ``SampledRows`` of a chain round of ``k`` drafts a sequence, ``sampled`` the indices in ``work`` of
        the requests that sample."""
        device = self.target.local.device
        params = [work[i].seq.params for i in sampled]
        return SampledRows(sampled, to_device(list(sampled), device), to_device([i * (k + 1) for i in sampled], device),
                           self._chain_temperatures(params, device),
                           draft_temperatures([w.seq.params for w in work], device))

    @staticmethod
    def _chain_temperatures(params: list[SamplingParams], device: torch.device) -> torch.Tensor | None:
        """The requests' temperatures [S] on the device where each sets nothing but one (the chain rule's fast
        path), else None."""
        if all(p.temperature_only and not p.greedy for p in params):
            return to_device([p.temperature for p in params], device, torch.float32)
        return None

    def _sampled_outcomes(self, work: list[DraftWork], rows: SampledRows, drafts: torch.Tensor,
                          q: torch.Tensor, logits: torch.Tensor, verdict: torch.Tensor) -> list[torch.Tensor]:
        """A chain round's outcomes on the device, its sampled rows ``rows`` accepted by the rejection rule
        with numbers from their streams: drafts [B, k], their q [B, k, vocab], the verify's logits [B * (k + 1),
        vocab] and verdict [B, 2k + 2] -> [the sampled rows' accepted drafts [S] and emitted tokens [S], every
        row's count [B] and tokens after its root [B, k + 1] (``chain_outcomes``)]."""
        k = int(drafts.shape[1])
        pick = rows.pick
        every = len(rows.indices) == len(work)  # (no copies of the rows taken)
        count, token, sampled_rows = self._accept_on_device([work[i] for i in rows.indices],
                                                            drafts if every else drafts.index_select(0, pick),
                                                            q if every else q.index_select(0, pick), logits,
                                                            rows.first_rows, rows.temperatures)
        if every:  # every chain's outcome is the rule's (no greedy row to merge: no launch more)
            return [count, token, count, sampled_rows]
        counts, tokens = self._chain_outcomes(drafts, verdict[:, k:2 * k + 1], pick, count, token)
        return [count, token, counts, tokens]

    def _follow(self, r: RoundInFlight, scheduler: Scheduler, max_len: int) -> RoundInFlight | None:
        """The round after ``r`` launched before ``r`` is read back: its verify replays on the inputs ``r``'s
        program staged (each root the token after the drafts the device accepted, rows, slots and context moved
        on by as many), its drafts the next chain's (drafted ahead behind ``r``'s verify), over block tables
        reserved three verifies past ``r``'s root (the one after it stages its slots from them); then the chain
        after it, staged by it. Only where ``r``'s sequences are all the running ones and still run, one of them
        has more than ``q`` tokens left before its ``max_tokens`` (else ``r`` may end them all, and a round after
        it would run for nothing: the next request's prefill would wait behind it), its tables reach the slots
        staged, and room is left within ``max_len`` and the free blocks; else None (nothing run). Its entries are made once ``r`` is read back (``_taken``)."""
        q = self.config.verify_tokens
        emits = self.config.num_steps + 1  # the most tokens a round emits
        reach = self.config.in_flight_reach
        bs = self.target.local.block_size
        assert r.work is not None
        if r.next_drafts is None or len(scheduler.running) != len(r.work):
            return None
        if all(w.seq.params.max_tokens - w.seq.num_output_tokens <= emits for w in r.work):
            return None  # r may reach every sequence's max_tokens: one launched after it would be waste
        if r.sampled and (r.next_q is None or self.drafter.first_chain_staged(len(r.work), sampled=True) is None):
            return None
        for w, covered in zip(r.work, r.covered):
            start = w.entry.start
            if not scheduler.is_running(w.entry.seq_id) or covered < start + emits + q or start + reach > max_len:
                return None
        tables = []
        for w in r.work:
            table = scheduler.reserve_ahead(w.entry.seq_id, w.entry.start + reach)
            if table is None:
                return None
            tables.append(table)
        local = self.target.local
        inputs = local.static_inputs(r.shape)
        b = len(r.work)
        if any(len(t) != len(w.entry.block_table) for t, w in zip(tables, r.work)):  # new blocks: the inputs take them
            width = max(len(t) for t in tables)
            flat = [x for t in tables for x in (*t, *[0] * (width - len(t)))]
            inputs.tables[:b, :width].copy_(to_device(flat, local.device).view(b, width))
        if r.is_tree:
            return self._follow_tree(r, inputs, tuple(tuple(t) for t in tables))
        if r.sampled:  # the program staged the greedy rule's outcome: move each row to the device's
            assert r.counts is not None and r.tokens is not None and r.greedy_counts is not None
            self._restage(inputs, r.counts, r.greedy_counts, r.tokens, r.next_drafts, b, q)
        else:
            inputs.ids.view(r.shape.batch, q)[:b, 1:].copy_(r.next_drafts[:, :q - 1])
        outputs = local.replay_staged(r.shape)
        logits, aux, verdict = outputs[0][:b * q], outputs[-2][:b * q], outputs[-1][:b]
        if not r.sampled:
            read = read_later(verdict.reshape(-1))
            drafts = self.drafter.replay_staged_chain(b, r.shape.batch)
            return RoundInFlight(None, None, r.shape, logits, aux.clone(), read, drafts,
                                 tuple(len(t) * bs for t in tables), tuple(tuple(t) for t in tables))
        assert r.next_q is not None and r.rows is not None
        outcome = self._sampled_outcomes(r.work, r.rows, r.next_drafts[:, :q - 1], r.next_q[:, :q - 1], logits,
                                         verdict)
        read = read_later(torch.cat([verdict.reshape(-1), *outcome[:2]]))
        counts, tokens = outcome[2:]
        chain = self.drafter.replay_staged_sampled(r.work, r.shape.batch, tokens, counts, r.rows.draft_temperatures)
        return RoundInFlight(None, None, r.shape, logits, aux.clone(), read, None if chain is None else chain[0],
                             tuple(len(t) * bs for t in tables), tuple(tuple(t) for t in tables), r.sampled,
                             None if chain is None else chain[1], None if chain is None else chain[2], counts, tokens,
                             verdict[:, -1].clone(), r.rows)

    def _follow_tree(self, r: RoundInFlight, inputs: StaticInputs, tables: tuple[tuple[int, ...], ...]
                     ) -> RoundInFlight:
        """``_follow`` for a tree round: the next verify's inputs (staged by ``r``'s program: roots, rows, slots,
        context) take the trees drafted behind ``r`` (tokens, RoPE positions = the root's + each node's depth,
        masks), it replays, its K/V moves are applied and the trees after it drafted on its staged first pass."""
        assert r.work is not None and r.next_tree is not None and inputs.tail is not None
        local = self.target.local
        b, n, pad = len(r.work), self.config.verify_tokens, r.shape.batch
        tree = r.next_tree
        inputs.ids.view(pad, n)[:b, 1:].copy_(tree.tokens[:, 1:])
        positions = inputs.positions.view(pad, n)[:b]
        positions[:, 1:].copy_(positions[:, :1] + tree.depths[:, 1:])
        inputs.tail.view(pad, n, n)[:b].copy_(tree.mask)
        outputs = local.replay_staged(r.shape)
        logits, aux, verdict, moves = outputs[0][:b * n], outputs[-3][:b * n], outputs[-2][:b], outputs[-1][:b]
        read = read_later(verdict.reshape(-1))
        apply_moves(local.kv_cache, moves, local.move_kv)
        nxt = self.drafter.replay_staged_tree(b, pad)
        bs = local.block_size
        return RoundInFlight(None, None, r.shape, logits, aux.clone(), read, None if nxt is None else nxt.tokens,
                             tuple(len(t) * bs for t in tables), tables, next_tree=nxt)

    def _taken(self, nxt: RoundInFlight, r: RoundInFlight, done: SpecStep) -> RoundInFlight:
        """``nxt`` (launched before ``r`` was read) with its entries, now that ``r``'s acceptance is known: each
        sequence's root after its accepted drafts, its table as reserved; its draft state takes the chain
        ``nxt`` verifies (drafted ahead behind ``r``: the first pass consumed ``r``'s aux rows) and holds the one
        drafted behind ``nxt``."""
        assert r.work is not None and nxt.tables is not None
        picks = dict(zip((s.seq_id for s in done.seqs), done.picks))
        entries: list[ScheduledSeq] = []
        work: list[DraftWork] = []
        for i, (w, table) in enumerate(zip(r.work, nxt.tables)):
            e, state = w.entry, w.state
            pick = picks.get(e.seq_id)
            if pick is None:  # finished while r was in flight: nxt's rows for it are dropped when read
                entry = replace(e, block_table=list(table))
            else:
                ahead = state.ahead
                start = e.start + len(pick.tokens)
                if ahead is None or ahead.start != start:
                    raise RuntimeError(f"sequence {e.seq_id}: the round launched ahead does not follow the one "
                                       f"read back (host and device acceptance differ)")
                entry = replace(e, token_ids=[pick.tokens[-1]], start=start, block_table=list(table), admitted=False)
                state.num_bases, state.pending = start, []
                sampled = nxt.next_q is not None and not w.seq.params.greedy
                state.ahead = None if nxt.next_drafts is None else Ahead(
                    nxt.next_drafts[i], nxt.next_q[i] if sampled and nxt.next_q is not None else None,
                    None if nxt.next_uniforms is None else nxt.next_uniforms[i], batch=nxt.next_drafts, row=i,
                    tree=nxt.next_tree)
            entries.append(entry)
            work.append(DraftWork(entry, w.seq, state, w.draw))
        return replace(nxt, batch=ScheduledBatch(seqs=entries), work=work)

    def _verified(self, r: RoundInFlight) -> Verified:
        """A launched greedy round read back (its one wait: the verify and its verdict, not what was queued
        after it): the drafts, the target's argmax of every row and the device's acceptance counts."""
        assert r.batch is not None and r.work is not None
        if r.is_tree:
            return self._verified_tree(r)
        work, batch = r.work, r.batch
        n = self.config.verify_tokens - 1
        flat = r.read()
        w = 2 * (n + 1)
        rows = [flat[i * w:i * w + n] for i in range(len(work))]
        argmax = [t for i in range(len(work)) for t in flat[i * w + n:i * w + 2 * n + 1]]
        proposals = dict(zip((w.entry.seq_id for w in work), self.drafter.chain_proposals(work, rows, None)))
        entries = [self._verify_entry(e, proposals[e.seq_id].tree) for e in batch.seqs]
        counts = [flat[i * w + w - 1] for i in range(len(work))]  # the greedy rule's; a sampled row's below
        end, m = len(work) * w, len(r.sampled)
        accepted: dict[int, Acceptance] = {}
        for i, c, t in zip(r.sampled, flat[end:end + m], flat[end + m:end + 2 * m]):
            accepted[work[i].entry.seq_id] = Acceptance.chain(rows[i], c, t)
            counts[i] = c
        drafted = dict(zip((wk.entry.seq_id for wk in work), counts)) if r.next_drafts is not None else {}
        return Verified(ScheduledBatch(seqs=entries, preempted=batch.preempted), r.logits, r.aux, proposals,
                        argmax, accepted, drafted)

    def _verified_tree(self, r: RoundInFlight) -> Verified:
        """A launched tree round read back (its one wait): per sequence the verified tree's tokens and parents, the
        target's argmax of every node and the device's acceptance count (``tree_verify_program.py``'s verdict); its
        accepted nodes' K/V were moved on the device."""
        assert r.batch is not None and r.work is not None
        n = self.config.verify_tokens
        w = 3 * n + 1
        flat = r.read()
        rows = [flat[i * w:(i + 1) * w] for i in range(len(r.work))]
        proposals = {wk.entry.seq_id: Proposal(DraftTree(tuple(row[:n]), tuple(row[n:2 * n])))
                     for wk, row in zip(r.work, rows)}
        entries = [self._verify_entry(e, proposals[e.seq_id].tree) for e in r.batch.seqs]
        argmax = [t for row in rows for t in row[2 * n:3 * n]]
        drafted = {wk.entry.seq_id: row[3 * n] for wk, row in zip(r.work, rows)} if r.next_tree is not None else {}
        return Verified(ScheduledBatch(seqs=entries, preempted=r.batch.preempted), r.logits, r.aux, proposals, argmax,
                        drafted=drafted, moved=True)

    def _deferred_verify(self, batch: ScheduledBatch, work: list[DraftWork], state_of: StateOf) -> Verified | None:
        """A chain on one rank: the drafts stay on the device, the verify forward is queued right behind
        the draft's replays with the drafts as its token ids (placeholders on the host), the sampled
        requests whose logits nothing adjusts are accepted on the device (``_accept_on_device``), the next
        round's chains are drafted on the device behind it where they can be (``Drafter.chain_after``), and all
        is read back after that together with the target's argmax of every logits row (one wait for draft,
        verify and acceptance), so the GPU runs draft, verify and the next draft back to back.
        None where this does not apply (several ranks take the step's token ids as values, a tree)."""
        if not work or not self.target.single_rank or not self.drafter.is_chain:
            return None
        drafts, q = self.drafter.chain(work)  # [B, num_steps] target ids (and sampled rows' q), on the device
        n = self.config.verify_tokens - 1
        drafting = {w.entry.seq_id: i for i, w in enumerate(work)}
        local = self.target.local
        pieces: list[torch.Tensor] = []
        placeholder: list[ScheduledSeq] = []
        for e in batch.seqs:
            i = drafting.get(e.seq_id)
            if i is None:
                pieces.append(to_device(e.token_ids, local.device))
                placeholder.append(e)
            else:
                pieces += [to_device(e.token_ids, local.device), drafts[i, :n]]
                placeholder.append(replace(e, token_ids=[*e.token_ids, *[0] * n], num_logits=n + 1))
        out = local.run(forward_step(ScheduledBatch(seqs=placeholder, preempted=batch.preempted)),
                        input_ids=torch.cat(pieces))
        sampled = [i for i, w in enumerate(work)
                   if not w.seq.params.greedy and not self.tokens.adjusts(w.seq, state_of(w.seq))]
        on_device: list[torch.Tensor] = []
        pick = None
        if sampled:
            assert q is not None  # some request samples
            first_row = dict(zip((e.seq_id for e in placeholder),
                                 itertools.accumulate((e.num_logits for e in placeholder), initial=0)))
            pick = to_device(sampled, local.device)
            on_device = list(self._accept_on_device([work[i] for i in sampled], drafts.index_select(0, pick)[:, :n],
                                                    q.index_select(0, pick)[:, :n], out.logits,
                                                    to_device([first_row[work[i].entry.seq_id] for i in sampled],
                                                              local.device),
                                                    self._chain_temperatures([work[i].seq.params for i in sampled],
                                                                             local.device))[:2])
        argmax = self.tokens.sampler.argmax(out.logits)
        aux = torch.cat(out.hidden, dim=-1)  # [num_tokens, 3H]: the layers' complete input streams
        ahead = self._acceptance_on_device(batch, work, drafts[:, :n], argmax, sampled, pick, on_device, state_of)
        # what is read back, gathered before the next draft's replay reuses the draft's output buffers
        read = read_later(torch.cat([drafts[:, :n].reshape(-1), argmax, *on_device, *ahead[:1]]))
        drafted_ahead = bool(ahead) and self.drafter.chain_after(work, ahead[1].reshape(-1), aux, ahead[0])
        flat = read()  # the step's one wait: draft, verify, acceptance (not the next draft, queued after them)
        rows = [flat[i * n:(i + 1) * n] for i in range(len(work))]
        proposals = dict(zip((w.entry.seq_id for w in work), self.drafter.chain_proposals(work, rows, q)))
        entries = [self._verify_entry(e, proposals[e.seq_id].tree) if e.seq_id in proposals else e
                   for e in batch.seqs]
        end = len(work) * n + int(argmax.shape[0])
        counts, tokens = flat[end:end + len(sampled)], flat[end + len(sampled):end + 2 * len(sampled)]
        accepted = {work[i].entry.seq_id: Acceptance.chain(rows[i], c, t)
                    for i, c, t in zip(sampled, counts, tokens)}
        drafted = dict(zip((w.entry.seq_id for w in work), flat[end + 2 * len(sampled):])) if drafted_ahead else {}
        return Verified(ScheduledBatch(seqs=entries, preempted=batch.preempted), out.logits, aux, proposals,
                        flat[len(work) * n:end], accepted, drafted)

    def _acceptance_on_device(self, batch: ScheduledBatch, work: list[DraftWork], drafts: torch.Tensor,
                              argmax: torch.Tensor, sampled: list[int], pick: torch.Tensor | None,
                              on_device: list[torch.Tensor], state_of: StateOf) -> list[torch.Tensor]:
        """Every chain's acceptance on the device, for drafting the next round's chains right behind this
        verify (``Drafter.chain_after``): a greedy row accepts its drafts up to the first that differs from
        the target's argmax (the raw logits: nothing adjusts them) and goes on with the argmax after them; a
        sampled row as ``_accept_on_device`` drew. Only where every sequence of the step drafts and every
        request is greedy or temperature-only with nothing adjusting its logits.
        -> [acceptance counts [B], the tokens after each root [B, num_steps + 1] (its accepted drafts, then the
        token emitted after them)], or [] where this does not apply. The counts are read back with the rest:
        ``_accept`` keeps a chain drafted ahead only where the host accepted as many."""
        if len(work) != len(batch.seqs) or not all(
                (w.seq.params.greedy or w.seq.params.temperature_only) and not self.tokens.adjusts(w.seq, state_of(w.seq))
                for w in work):
            return []
        count, token = on_device if sampled else (None, None)
        return list(self._chain_outcomes(drafts, argmax.view(len(work), -1), pick if sampled else None, count, token))

    def _accept_on_device(self, work: list[DraftWork], drafts: torch.Tensor, q: torch.Tensor, logits: torch.Tensor,
                          first_rows: torch.Tensor, temperatures: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The standard rule for sampled chains, on the device (nothing read back): drafts [S, k], their q
        [S, k, vocab] and each chain's k + 1 logits rows from ``first_rows`` [S] (on the device); the uniform
        numbers from each request's own stream; ``temperatures`` [S] where every request sets nothing but one
        (``_chain_temperatures``: the fast path). -> (accepted drafts [S], emitted tokens [S], each chain's tokens
        after its root [S, k + 1] (``chain_rows``))"""
        k = int(drafts.shape[1])
        device = logits.device
        uniforms = draws(work, k + 1, device)
        if temperatures is not None:  # the fast path (one launch on a GPU)
            return self._accept_at_temperature(logits, first_rows, temperatures, drafts, q, uniforms)
        params = [w.seq.params for w in work]
        rows = (first_rows.to(device)[:, None] + torch.arange(k + 1, device=device)).reshape(-1)
        probs = self.sampler.probs(logits.index_select(0, rows), [p for p in params for _ in range(k + 1)])
        count, token = accept_chains_sampled(drafts, q, probs.view(len(work), k + 1, -1), uniforms)
        return count, token, chain_rows(drafts, count, token)

    def _deferred_tree(self, batch: ScheduledBatch, work: list[DraftWork]) -> Verified | None:
        """A tree on one rank: the draft trees are grown on the device (``Drafter.tree_on_device``) and the
        verify is queued behind the draft steps with the trees' tokens, positions and masks as device
        inputs (placeholders on the host size the step); the trees are read back after it together with
        the target's argmax of every row (the step's one wait). None where this does not apply (several
        ranks take the step's values, a step with sequences that do not draft, a shape not captured)."""
        if (not work or not self.target.single_rank or self.drafter.is_chain
                or len(work) != len(batch.seqs)):
            return None
        n = self.config.verify_tokens
        step = self._tree_step(work)
        local = self.target.local
        if local.graph_shape(step) is None:
            return None
        tree = self.drafter.tree_on_device(work)
        if tree is None:
            return None
        b = len(work)
        out = local.run(step, **self._tree_inputs(work, tree))
        # the read-back is queued behind the verify: the step's one wait, for the trees and the verify
        flat = torch.cat([tree.tokens.reshape(-1), tree.parents.reshape(-1),
                          self.tokens.sampler.argmax(out.logits)]).tolist()
        proposals = {w.entry.seq_id: Proposal(DraftTree(tuple(flat[i * n:(i + 1) * n]),
                                                        tuple(flat[(b + i) * n:(b + i + 1) * n])))
                     for i, w in enumerate(work)}
        entries = [self._verify_entry(e, proposals[e.seq_id].tree) for e in batch.seqs]
        return Verified(ScheduledBatch(seqs=entries, preempted=batch.preempted), out.logits,
                        torch.cat(out.hidden, dim=-1), proposals, flat[2 * b * n:])

    @staticmethod
    def _drafts(e: ScheduledSeq, state: DraftState) -> bool:
        """Decoding, with a base to feed the draft's first pass (its last row is the root's)."""
        return e.num_tokens == 1 and e.num_logits == 1 and state.num_pending >= 1

    def _verify_entry(self, e: ScheduledSeq, tree: DraftTree) -> ScheduledSeq:
        chain = tree.is_chain  # attends causally at consecutive positions: no mask needed
        return replace(e, token_ids=list(tree.tokens), num_logits=tree.num_nodes,
                       position_ids=None if chain else tree_positions(tree.parents, e.start),
                       tree_parents=None if chain else tree.parents)

    def _draw(self, generator: torch.Generator | None) -> Uniforms:
        g = generator or self.sampler.generator
        device = self.sampler.device
        return lambda n: torch.rand(n, generator=g, dtype=torch.float64, device=device)

    # --- drafting -----------------------------------------------------------------------------

    def propose(self, work: list[DraftWork]) -> list[Proposal]:
        """Each decoding sequence's draft tree (tests may stand in for the draft here)."""
        return self.drafter.propose(work)

    # --- verification -------------------------------------------------------------------------

    def _accept(self, verified: Verified, seqs: list[Sequence], draws: dict[int, Uniforms], state_of: StateOf
                ) -> dict[int, Pick]:
        """A Pick per entry with logits (by index); queues aux rows, moves accepted K/V, counts, and
        keeps a chain drafted ahead where the device accepted as many drafts as the host.
        ``verified.argmax``: the raw logits' argmax per row, read back already (a greedy request whose
        logits nothing adjusts verifies with it, without another wait); ``verified.accepted``: outcomes
        drawn on the device and read back already, by sequence."""
        run, logits, aux, proposals = verified.run, verified.logits, verified.aux, verified.proposals
        argmax, accepted = verified.argmax, verified.accepted
        results: dict[int, Pick] = {}
        plain: list[tuple[int, int]] = []  # (entry index, first logits row)
        src: list[int] = []
        dst: list[int] = []
        bs = self.target.local.block_size
        tok_row = logit_row = 0
        for i, (e, seq) in enumerate(zip(run.seqs, seqs)):
            if seq.is_finished:  # stopped or aborted while its round was in flight
                tok_row += e.num_tokens
                logit_row += e.num_logits
                continue
            state = self._states[e.seq_id]
            prop = proposals.get(e.seq_id)
            if prop is None:
                state.pending.append(aux[tok_row: tok_row + e.num_tokens])
                if e.num_logits:
                    plain.append((i, logit_row))
            else:
                node_logits = logits[logit_row: logit_row + e.num_logits]
                known = None if argmax is None else argmax[logit_row: logit_row + e.num_logits]
                acc = accepted.get(e.seq_id) or self._verify(prop, seq, state_of(seq), node_logits,
                                                             draws[e.seq_id], known)
                self.counters.record(prop.tree.num_nodes - 1, acc.num_accepted)
                if e.seq_id in verified.drafted:
                    Drafter.settle_ahead(state, e.start + acc.num_accepted + 1, acc.num_accepted,
                                         verified.drafted[e.seq_id])
                path = acc.path
                if path == tuple(range(1, len(path) + 1)):  # a chain's: the root's row and the next ones, a view
                    state.pending.append(aux[tok_row: tok_row + 1 + len(path)])
                else:
                    rows = to_device([tok_row, *(tok_row + k for k in path)], aux.device)
                    state.pending.append(aux.index_select(0, rows))
                table = e.block_table
                for a, b in () if verified.moved else relocation(acc.path):
                    src.append(table[(e.start + a) // bs] * bs + (e.start + a) % bs)
                    dst.append(table[(e.start + b) // bs] * bs + (e.start + b) % bs)
                drawn_at = [0, *acc.path]  # the node row each emitted token was drawn at
                # (indexing by a host list copies it synchronously: only when the request asked for logprobs)
                logprobs = [] if seq.params.logprobs is None else self.tokens.logprobs(
                    node_logits[drawn_at], seq, list(acc.tokens))
                results[i] = Pick(list(acc.tokens), logprobs, [])
            tok_row += e.num_tokens
            logit_row += e.num_logits
        if src:
            self.target.copy_kv(src, dst)
        if plain:
            entries = [(run.seqs[i], seqs[i], state_of(seqs[i])) for i, _ in plain]
            picks = self.tokens.pick(logits, entries, [r for _, r in plain])
            results.update({i: pick for (i, _), pick in zip(plain, picks)})
        return results

    def _verify(self, prop: Proposal, seq: Sequence, state: RequestState, logits: torch.Tensor,
                draw: Uniforms, raw_argmax: list[int] | None = None) -> Acceptance:
        """logits: [num_nodes, vocab] raw, row i = the target after node i; adjusted per node with the
        drafts on the path to it as history. raw_argmax: their argmax, already on the host, or None."""
        tree = prop.tree
        if seq.params.greedy and raw_argmax is not None and not self.tokens.adjusts(seq, state):
            return accept_greedy(tree, raw_argmax)
        adjusted = self.tokens.adjusted(logits, seq, state, paths(tree))
        if seq.params.greedy:
            return accept_greedy(tree, adjusted.argmax(dim=-1).tolist())
        p = self.sampler.probs(adjusted, [seq.params] * tree.num_nodes)
        if prop.draft_probs is not None:
            return verify_chain_sampled(list(tree.tokens[1:]), prop.draft_probs, p, draw(tree.num_nodes))
        return verify_tree_sampled(tree, p, draw(tree.num_nodes))


@functools.cache
def _layout_mask(nodes: int) -> tuple[bool, ...]:
    """A tree verify's host mask where the device supplies the real one: its size alone matters."""
    return (True,) * (nodes * nodes)


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's draft tokens from the root's first child down to the node itself (the root: none)."""
    out: list[tuple[int, ...]] = [()]
    for i in range(1, tree.num_nodes):
        out.append((*out[tree.parents[i]], tree.tokens[i]))
    return out
