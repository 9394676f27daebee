"""Proposes each decoding sequence's draft tree with the EAGLE3 draft (leader only).

Per sequence and step (``n`` = the position of the last known token, the root):

1. The draft's first pass over every base the target computed since the last draft (their aux
   states come from the target's forwards; after a prompt's prefill this warms the draft cache):
   base b reads token b + 1 with aux state b at RoPE b + 1. Its last row (base n - 1, the root
   token) gives the first draft step's distribution and the hidden state its children are fed.
2. Steps j = 1 .. num_steps - 1: the ``topk`` best leaves at depth j (a chain: the one draft)
   are fed at RoPE n + j with their parent's output hidden state; each sees the bases, its
   ancestors and itself (``draft_model.py``'s slot layout); each adds ``topk`` children.
3. ``TreeBuilder.build``: the root and the ``num_nodes - 1`` best candidates.

Candidates are the draft's top-k by log-probability, except for a sampled request's chain, whose
drafts are drawn from the draft's distribution q (kept for the rejection rule): at temperature 1 that
accepts more than the draft's argmax would (SmolLM2's pair on CPU, 12 + 12 prompts, chain-5: 1.96 /
2.11 against 1.35 / 1.76).

A chain (topk 1, ``chain``) leaves its drafts on the device for the caller's one read-back: every
request greedy, steps 1 .. num_steps - 1 run as one chained replay (``StepExecutor.run_chain``: each
step's argmax token and hidden state feed the next on the device) where one is captured for the batch;
otherwise one forward a step, each step's draft drawn on the device from its q with the request's
uniform numbers. A tree on one rank
grows on the device instead (``tree_on_device``: ``grow_tree`` over ``device_tree.TreeGrowth``, the same
candidates, leaves and masks as steps 2-3 here; steps 1 .. num_steps - 1 and the tree's build are one
replay of a captured tree chain, nothing read back in between) wherever the tree chain is captured; the
step-by-step path stays the reference (several ranks, eager forwards, a batch not all drafting). On a GPU
each step's expand is one kernel (``tree_expand_triton``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

import torch

from ...models.eagle3 import Eagle3Draft
from ..engine.sampler import Sampler, sample_from_probs
from ..engine.scheduler import ScheduledSeq
from ..engine.sequence import SamplingParams, Sequence
from ..executor.executor import StepExecutor
from ..executor.gpu_kernel import gpu_kernel
from ..executor.host_copy import to_device
from ..executor.step import SeqRows, Step
from ..executor.step_graphs import StaticInputs, TreeForward
from ..executor.step_shape import StepShape
from .config import tree_reach
from .device_tree import DeviceTree, TreeGrowth, TreeKernels
from .draft_tree import DraftTree, TreeBuilder
from .rejection_sampler import Uniforms


@dataclass
class Ahead:
    """A sequence's next chain, drafted on the device before the host read its last verify back
    (``Drafter.chain_after``): valid for the step whose root is at ``start`` (None until the host knows
    the acceptance), when the draft's first pass over its bases [num_bases, start) already ran."""

    drafts: torch.Tensor  # [num_steps] target ids
    q: torch.Tensor | None  # [num_steps, vocab]: a sampled request's distributions
    uniforms: torch.Tensor | None  # [num_steps]: the numbers its draws took from the request's stream
    start: int | None = None
    batch: torch.Tensor | None = None  # [B, num_steps]: the chains drafted with it (``drafts`` is row ``row``)
    row: int = 0
    tree: DeviceTree | None = None  # a tree round's: the trees drafted with it (row ``row``; roots left 0)


@dataclass
class DraftState:
    """A sequence's draft progress: bases [0, num_bases) are in the draft cache; ``pending``
    holds the target's aux rows of the positions after them ([rows, 3H] each); ``ahead``: its
    next chain, already drafted (the pending rows then went into its first pass)."""

    num_bases: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    ahead: Ahead | None = None

    @property
    def num_pending(self) -> int:
        return sum(int(t.shape[0]) for t in self.pending)


@dataclass
class DraftWork:
    """One decoding sequence to draft for: its scheduled entry (one token, the root), its state
    and its random stream."""

    entry: ScheduledSeq
    seq: Sequence
    state: DraftState
    draw: Uniforms


@dataclass(frozen=True)
class Proposal:
    tree: DraftTree
    draft_probs: torch.Tensor | None = None  # [drafts, vocab]: a sampled chain's q per draft


class Drafter:
    def __init__(self, draft: StepExecutor, model: Eagle3Draft, sampler: Sampler, vocab: int, num_steps: int, topk: int,
                 num_nodes: int) -> None:
        self.draft = draft
        self.sampler = sampler
        self.num_steps = num_steps
        self.topk = topk
        self.num_nodes = num_nodes  # verified tree nodes, the root included
        self.is_chain = topk == 1
        self._vocab = vocab
        self._draft_to_target = model.to_target_ids(torch.arange(model.draft_vocab, device=draft.device))
        self._argmax_to = model.argmax_to  # the kernel set's table[argmax(row)]
        self._hidden = int(model.config.hidden_size)  # the chained steps' hidden input
        self._aux = int(model.fc.in_features)  # the first pass's hidden input: the target's aux states
        self._staged: dict[tuple[int, bool], tuple[StepShape, StaticInputs] | None] = {}  # ``first_chain_staged``
        self._tree_staged: dict[int, tuple[StepShape, StaticInputs] | None] = {}  # ``first_tree_staged``
        self._tree_kernels = tree_kernels(draft.device)  # a device tree's start, steps and build fused (GPU), or None
        self._top_k_rows = top_k_kernel(draft.device, model.draft_vocab)  # the draft's top-k (GPU), or torch's

    def propose(self, work: list[DraftWork]) -> list[Proposal]:
        """Each sequence's draft tree."""
        if not work:
            return []
        width = self.topk
        if self.is_chain:
            drafts, q = self.chain(work)
            return self.chain_proposals(work, drafts[:, : self.num_nodes - 1].tolist(), q)
        logits, root_hidden = self._first_pass(work)
        builders = [TreeBuilder(w.seq.token_ids(w.entry.start, w.entry.start + 1)[0]) for w in work]
        feed_hidden: list[dict[int, torch.Tensor]] = [{} for _ in work]
        leaves: list[list[int]] = []
        children = self._children(builders, logits, [[-1] for _ in work])
        for i, kids in enumerate(children):
            feed_hidden[i].update({c: root_hidden[i] for c in kids})
            leaves.append(kids)
        slot_of: list[dict[int, int]] = [{} for _ in work]
        for j in range(1, self.num_steps):
            inputs, rows = [], []
            for i, w in enumerate(work):
                n = w.entry.start
                for r, c in enumerate(leaves[i]):
                    slot_of[i][c] = n + (j - 1) * width + r
                ctx = n + j * width
                mask = self._draft_mask(builders[i], leaves[i], slot_of[i], n, ctx)  # a tree: chains returned above
                inputs.append(SeqRows(tuple(w.entry.block_table), tuple(builders[i].token(c) for c in leaves[i]),
                                      (n + j,) * len(leaves[i]), ctx, len(leaves[i]), mask))
                rows += [feed_hidden[i][c] for c in leaves[i]]
            logits, out = self._run(inputs, torch.stack(rows))
            children = self._children(builders, logits, leaves)
            row = 0
            for i, kids_per_leaf in enumerate(self._split(children, leaves)):
                new: list[int] = []
                for kids in kids_per_leaf:
                    feed_hidden[i].update({c: out[row] for c in kids})
                    new += kids
                    row += 1
                leaves[i] = builders[i].best(new, width)
        return [Proposal(b.build(self.num_nodes)) for b in builders]

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's greedy choice as target ids. logits: [rows, draft_vocab] -> [rows] (on the device;
        the chained replay's feed)."""
        return self._argmax_to(logits, self._draft_to_target)

    def sample_tokens(self, logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draft drawn from the draft's distribution at the row's temperature (0: one-hot on the
        argmax), with its uniform number: ``Sampler.probs`` for a request that sets nothing but a
        temperature, and graph-safe (a sampled chained replay's draw; two launches on a GPU,
        ``Sampler.at_temperature``). logits: [rows, draft_vocab]; temperatures: [rows]; uniforms: [rows]
        -> (target ids [rows], q [rows, draft_vocab] float32)"""
        tokens, q = self.sampler.at_temperature(logits, temperatures, uniforms, self._draft_to_target, True)
        assert q is not None
        return tokens, q

    def chain(self, work: list[DraftWork]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chain's drafts, left on the device: the first pass, then steps 1 .. num_steps - 1 (step j's
        one row per sequence at RoPE n + j in slot n + j - 1, fed the step before's draft and hidden state
        on the device) — first pass and steps in one replay where such a shape is captured for the batch
        (``run_first_chain``), else the first pass and one chained replay of the steps (``run_chain``),
        else one forward each. Every request greedy: the draft's argmax. Otherwise every row draws its
        draft from q (its request's temperature, min-p, top-k, top-p; a greedy row's q is one-hot on the
        argmax) with numbers from its own stream (in the replays where no request sets more than a
        temperature). Nothing is read back.
        -> (drafts [len(work), num_steps] target ids, each draft's q over the target vocabulary
        [len(work), num_steps, vocab], or None when every request is greedy)"""
        ready = [w.state.ahead for w in work]
        for w in work:
            w.state.ahead = None
        if all(a is not None and a.start == w.entry.start for a, w in zip(ready, work)):
            for w in work:  # the drafted-ahead first pass consumed the pending rows
                w.state.num_bases, w.state.pending = w.entry.start, []
            done = [a for a in ready if a is not None]
            q = self.ahead_q(done)
            whole = done[0].batch
            if whole is not None and whole.shape[0] == len(done) and all(
                    a.batch is whole and a.row == i for i, a in enumerate(done)):
                return whole, q  # drafted together, in this order
            return torch.stack([a.drafts for a in done]), q
        seqs, aux = self._first_pass_inputs(work)
        rest = self.num_steps - 1
        params = [w.seq.params for w in work]
        greedy = all(p.greedy for p in params)
        # a chain drafted ahead but not taken already drew its numbers: they are this chain's (the request's
        # stream stays where it would be without drafting ahead)
        drawn = [None if a is None else a.uniforms for a in ready]
        uniforms = None if greedy else torch.stack(
            [w.draw(self.num_steps) if d is None else d for d, w in zip(drawn, work)]).to(aux.device)
        temperatures = None
        if not greedy and all(p.greedy or p.temperature_only for p in params):
            temperatures = draft_temperatures(params, aux.device)
        if rest and (greedy or temperatures is not None):
            sampling = None if temperatures is None or uniforms is None else (temperatures, uniforms)
            fused = self.draft.run_first_chain(Step(seqs), aux, rest, sampling)
            if fused is not None:
                return fused[0], None if greedy else self._on_target(fused[1])
        logits, hidden = self._first_pass_run(seqs, aux)
        steps = tuple(SeqRows(tuple(w.entry.block_table), (0,), (w.entry.start + 1,), w.entry.start + 1)
                      for w in work)  # token ids: the first drafts, on the device
        if greedy:
            first = self.greedy_tokens(logits)  # [B]: each root's first draft
            fed = self.draft.run_chain(Step(steps), hidden, first, rest) if rest else []
            if fed is not None:
                return torch.cat([first[:, None], *fed], dim=1), None
            return self._chain_steps(work, hidden, [first], self.greedy_tokens), None
        assert uniforms is not None
        qs: list[torch.Tensor] = []
        if temperatures is not None:
            first, q = self.sample_tokens(logits, temperatures, uniforms[:, 0])
            out = self.draft.run_chain(Step(steps), hidden, first, rest, (temperatures, uniforms[:, 1:])) if rest else []
            if out is not None:
                drafts = torch.cat([first[:, None], *out[:1]], dim=1)
                qs = [q[:, None], *out[1:]]
            else:
                qs = [q]
                drafts = self._chain_steps(work, hidden, [first], lambda lg: self._sampled(lg, params, uniforms, qs))
        else:
            drafts = self._chain_steps(work, hidden, [self._sampled(logits, params, uniforms, qs)],
                                       lambda lg: self._sampled(lg, params, uniforms, qs))
        return drafts, self._on_target(torch.cat([q if q.dim() == 3 else q[:, None] for q in qs], dim=1))

    @staticmethod
    def ahead_q(done: list[Ahead]) -> torch.Tensor | None:
        """Chains drafted ahead -> their q stacked [B, num_steps, vocab] (zeros for a greedy request's), or None
        where every request is greedy."""
        given = [a.q for a in done]
        some = next((x for x in given if x is not None), None)
        return None if some is None else torch.stack([some.new_zeros(some.shape) if x is None else x for x in given])

    def chain_after(self, work: list[DraftWork], tokens: torch.Tensor, aux: torch.Tensor, counts: torch.Tensor
                    ) -> bool:
        """Each sequence's next chain, drafted now, on the device, before the host knows how many of this
        round's ``num_steps`` drafts its verify accepted: ``counts`` [B] (the device's acceptance), ``tokens``
        [B * (num_steps + 1)] (per sequence the tokens after the root and its accepted drafts: the accepted
        drafts, then the token emitted after them; the rest any), ``aux`` the verify's aux rows [same, 3H]. The
        first pass lays out every draft as accepted and drops the rejected rows on the device
        (``run_first_chain``'s ``drop``); its chain is stored in each state's ``ahead`` for the step whose root
        follows the accepted drafts (``settle_ahead`` says which, once read back). False (nothing run) where no
        captured shape or the block tables do not reach that far; every request must be greedy or temperature-only
        (the caller checks)."""
        k = self.num_steps
        bs = self.draft.block_size
        if k < 2 or any(len(w.entry.block_table) * bs < w.entry.start + 2 * k for w in work):
            return False
        seqs = Step(tuple(SeqRows(tuple(w.entry.block_table), (0,) * (k + 1),
                                  tuple(range(w.entry.start + 1, w.entry.start + k + 2)), w.entry.start + k + 1)
                          for w in work))  # bases start .. start + k, as if every draft were accepted
        params = [w.seq.params for w in work]
        if self.draft.first_chain_shape(seqs, int(aux.shape[-1]), k - 1, not all(p.greedy for p in params)) is None:
            return False
        sampling = None
        if not all(p.greedy for p in params):
            sampling = (draft_temperatures(params, aux.device), draws(work, k, aux.device))
        uniforms = None if sampling is None else sampling[1]
        out = self.draft.run_first_chain(seqs, aux, k - 1, sampling, drop=k - counts, input_ids=tokens)
        assert out is not None  # first_chain_shape said one fits
        q = None if sampling is None else self._on_target(out[1])
        drafts = out[0].clone()  # the replay's output buffer serves its next replay too
        for i, w in enumerate(work):
            greedy = w.seq.params.greedy
            w.state.ahead = Ahead(drafts[i], None if q is None or greedy else q[i],
                                  None if uniforms is None else uniforms[i], batch=drafts, row=i)
        return True

    def first_chain_staged(self, num_seqs: int, sampled: bool = False) -> tuple[StepShape, StaticInputs] | None:
        """The greedy first pass + chain of ``chain_after`` that ``num_seqs`` sequences replay at and its static
        inputs, for the verify's program to stage (``verify_program.py``): captured with exactly the verify's
        rows (the root and ``num_steps`` drafts) per sequence; None where not. ``sampled``: the sampled chain of
        the same rows, whose static inputs are the greedy one's (the same layout of the draft's buffers; None
        where they are not), so what the program stages serves it too once its token ids and dropped rows are
        the sampled round's (``replay_staged_sampled``)."""
        key = (num_seqs, sampled)
        if key not in self._staged:  # fixed once captured
            k = self.num_steps
            shape = None if k < 2 else self.draft.first_chain_at(num_seqs, k + 1, self._aux, k - 1, sampled)
            staged = None if shape is None or shape.tokens != k + 1 else (shape, self.draft.static_inputs(shape))
            greedy = self.first_chain_staged(num_seqs) if sampled else None
            if sampled and (staged is None or greedy is None or greedy[0].batch != staged[0].batch
                            or staged[1].ids.data_ptr() != greedy[1].ids.data_ptr()
                            or staged[1].drop is None or greedy[1].drop is None
                            or staged[1].drop.data_ptr() != greedy[1].drop.data_ptr()):
                staged = None
            self._staged[key] = staged
        return self._staged[key]

    def chain_after_staged(self, work: list[DraftWork], batch: int) -> bool:
        """``chain_after`` for a greedy round whose verify (at padded ``batch``) staged the first pass's inputs on
        the device (``verify_program.py``): its replay alone, nothing packed or copied. False (nothing run) where
        the block tables do not reach that far or no staged shape of that batch is captured."""
        k = self.num_steps
        bs = self.draft.block_size
        if any(len(w.entry.block_table) * bs < w.entry.start + 2 * k for w in work):
            return False
        drafts = self.replay_staged_chain(len(work), batch)
        if drafts is None:
            return False
        for i, w in enumerate(work):
            w.state.ahead = Ahead(drafts[i], None, None, batch=drafts, row=i)
        return True

    def replay_staged_sampled(self, work: list[DraftWork], batch: int, tokens: torch.Tensor, counts: torch.Tensor,
                              temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``chain_after`` for a round with sampled requests whose verify (at padded ``batch``) staged the greedy
        first pass: its token ids become ``tokens`` [B, num_steps + 1] (the accepted drafts, then the token
        emitted after them) and its dropped rows follow ``counts`` [B] (the device's acceptance), then the sampled
        chain replays on it with each request's temperature (``temperatures`` [B], ``draft_temperatures``) and
        numbers drawn from its stream (as ``chain_after`` draws them). -> (drafts [B, num_steps], their q over the
        target's vocabulary [B, num_steps, vocab], the numbers [B, num_steps]), or None (nothing run, nothing drawn) where no such
        staged shape of that batch is captured. The caller has checked the block tables."""
        b, k = len(work), self.num_steps
        staged = self.first_chain_staged(b, sampled=True)
        if staged is None or staged[0].batch != batch:
            return None
        shape, inputs = staged
        assert inputs.drop is not None
        inputs.ids[:b * (k + 1)].copy_(tokens.reshape(-1))
        inputs.drop[:b].copy_(k - counts)
        device = tokens.device
        uniforms = draws(work, k, device)
        out = self.draft.replay_staged(shape, (temperatures, uniforms))
        return out[0][:b].clone(), self._on_target(out[1][:b]), uniforms

    def replay_staged_chain(self, num_seqs: int, batch: int) -> torch.Tensor | None:
        """The staged first pass + chain of ``num_seqs`` sequences replayed as a verify at padded ``batch`` staged
        it -> their drafts [num_seqs, num_steps] (a copy: the replay's output serves the next), or None where no
        staged shape of that batch is captured. The caller has checked the block tables."""
        staged = self.first_chain_staged(num_seqs)
        if staged is None or staged[0].batch != batch:
            return None
        return self.draft.replay_staged(staged[0])[0][:num_seqs].clone()

    @staticmethod
    def settle_ahead(state: DraftState, start: int, count: int, device_count: int) -> None:
        """The host read the verify back: the sequence's next root is at ``start`` if it goes on; its chain
        drafted ahead stands only if the device accepted as many drafts as the host (``device_count``)."""
        if state.ahead is not None:  # (not taken: its numbers drawn stay for the chain drafted instead)
            state.ahead = replace(state.ahead, start=start if count == device_count else None)

    def _on_target(self, q: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary distributions [B, steps, draft_vocab] -> over the target's vocabulary."""
        out = q.new_zeros(q.shape[0], q.shape[1], self._vocab)
        out[:, :, self._draft_to_target] = q
        return out

    def _sampled(self, logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor,
                 qs: list[torch.Tensor]) -> torch.Tensor:
        """Chain step ``len(qs)``'s drafts drawn from ``Sampler.probs`` (appended to ``qs``). -> target ids [B]"""
        q = self.sampler.probs(logits, params)
        qs.append(q)
        return self._draft_to_target[sample_from_probs(q, uniforms[:, len(qs) - 1])]

    def _chain_steps(self, work: list[DraftWork], hidden: torch.Tensor, drafts: list[torch.Tensor],
                     feed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Chain steps 1 .. num_steps - 1 one forward each after the first draft (``drafts``: [[B]]), each
        step's logits turned into the next draft by ``feed``. -> [B, num_steps]"""
        for j in range(1, self.num_steps):
            step = Step(tuple(SeqRows(tuple(w.entry.block_table), (0,), (w.entry.start + j,), w.entry.start + j)
                              for w in work))
            out = self.draft.run(step, hidden, input_ids=drafts[-1])
            hidden = out.hidden[0]
            drafts.append(feed(out.logits.float()))
        return torch.stack(drafts, dim=1)

    def tree_on_device(self, work: list[DraftWork]) -> DeviceTree | None:
        """Every sequence's verified draft tree grown on the device: the first pass, then one replay of
        the captured tree chain (``grow_tree``: the ``propose`` tree's rule, nothing read back in between);
        or the trees drafted ahead behind the last verify (``tree_after_staged``) where every sequence's stands
        for its root. None (before running anything) when no tree chain fits."""
        k, chain = self.topk, self.num_steps - 1
        ready = [w.state.ahead for w in work]
        for w in work:
            w.state.ahead = None
        whole = ready[0].tree if ready and ready[0] is not None else None
        if whole is not None and int(whole.tokens.shape[0]) == len(work) and all(
                a is not None and a.tree is whole and a.row == i and a.start == w.entry.start
                for i, (a, w) in enumerate(zip(ready, work))):
            for w in work:  # the drafted-ahead first pass consumed the pending rows
                w.state.num_bases, w.state.pending = w.entry.start, []
            roots = to_device([w.entry.token_ids[0] for w in work], whole.tokens.device)
            return replace(whole, tokens=torch.cat([roots[:, None], whole.tokens[:, 1:]], dim=1))
        if chain < 1 or self.draft.tree_chain_shape(len(work), self._hidden, chain, k) is None:
            return None
        logits, root_hidden = self._first_pass(work)
        top_tokens, top_lp = self._top_k(logits)
        # step 1's layout: ``topk`` leaves per sequence at RoPE n + 1 in slots n + r (masks from the program)
        first = Step(tuple(SeqRows(tuple(w.entry.block_table), (0,) * k, (w.entry.start + 1,) * k,
                                   w.entry.start + k, k) for w in work))
        out = self.draft.run_tree_chain(first, root_hidden.repeat_interleave(k, dim=0), top_tokens.reshape(-1),
                                        top_lp.reshape(-1), chain)
        assert out is not None  # tree_chain_shape said a shape fits
        tokens, parents, depths, mask = out
        roots = to_device([w.entry.token_ids[0] for w in work], logits.device)
        return DeviceTree(torch.cat([roots[:, None], tokens[:, 1:]], dim=1), parents, depths, mask)

    def first_leaves(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree's first leaves from the first pass's root rows (a captured first pass + tree chain's pick):
        the draft's ``topk`` best as target ids and their log-probabilities, [B, topk] each (``tree_on_device``'s)."""
        return self._top_k(logits)  # (both top-k paths read the logits as fp32 themselves: no cast launch here)

    def first_tree_staged(self, num_seqs: int) -> tuple[StepShape, StaticInputs] | None:
        """The first pass + tree chain that ``num_seqs`` sequences replay at and its static inputs, for a tree
        verify's program to stage (``tree_verify_program.py``): ``num_steps + 1`` rows per sequence (the root and
        at most ``num_steps`` accepted nodes); None where not captured."""
        if num_seqs not in self._tree_staged:  # fixed once captured
            k, chain = self.num_steps, self.num_steps - 1
            shape = None if chain < 1 or self.is_chain else self.draft.tree_first_at(num_seqs, k + 1, self._aux, chain,
                                                                                      self.topk)
            self._tree_staged[num_seqs] = None if shape is None else (shape, self.draft.static_inputs(shape))
        return self._tree_staged[num_seqs]

    def tree_after_staged(self, work: list[DraftWork], batch: int) -> DeviceTree | None:
        """Each sequence's next tree, drafted now on the device behind a tree verify (at padded ``batch``) whose
        program staged the first pass (``tree_verify_program.py``): the staged first pass + tree chain replayed,
        nothing packed or copied; stored in each state's ``ahead`` (for the step whose root follows the accepted
        nodes: ``settle_ahead``) -> the trees (roots left 0, a copy: the replay's outputs serve the next), or None
        (nothing run) where the block tables do not reach that far or no such staged shape is captured."""
        bs = self.draft.block_size
        reach = tree_reach(self.num_steps, self.topk)
        if any(len(w.entry.block_table) * bs < w.entry.start + reach for w in work):
            return None
        tree = self.replay_staged_tree(len(work), batch)
        if tree is not None:
            for i, w in enumerate(work):
                w.state.ahead = Ahead(tree.tokens[i], None, None, batch=tree.tokens, row=i, tree=tree)
        return tree

    def replay_staged_tree(self, num_seqs: int, batch: int) -> DeviceTree | None:
        """The staged first pass + tree chain of ``num_seqs`` sequences replayed as a tree verify at padded ``batch``
        staged it -> their trees (roots left 0; a copy: the replay's outputs serve the next), or None where no staged
        shape of that batch is captured. The caller has checked the block tables."""
        staged = self.first_tree_staged(num_seqs)
        if staged is None or staged[0].batch != batch:
            return None
        tokens, parents, depths, mask = (t[:num_seqs].clone() for t in self.draft.replay_staged(staged[0])[:4])
        return DeviceTree(tokens, parents, depths, mask)

    def grow_tree(self, forward: TreeForward, tokens: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
        """A captured tree chain's program (``StepGraphs``): the trees grown from the first leaves (the
        root's top-k: tokens, scores [B, k], hidden inputs [B, k, H]) over draft steps 1 .. num_steps - 1
        and built. -> tokens (the root's column left 0), parents, depths, masks of the verified trees."""
        roots = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        growth = TreeGrowth(roots, tokens, scores, hidden[:, 0], self.num_steps, self._tree_kernels)
        for j in range(1, self.num_steps):
            ids, h, rows = growth.feed()
            logits, out = forward(j, ids, h, rows)
            growth.expand(*self._top_k(logits), out)
        tree = growth.build(self.num_nodes)
        return tree.tokens, tree.parents, tree.depths, tree.mask

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's ``topk`` best per row as target ids and their log-probabilities (``_children``'s)."""
        top_lp, targets = self._top_k_rows(logits, self.topk, self._draft_to_target)
        return targets, top_lp

    def chain_proposals(self, work: list[DraftWork], rows: list[list[int]], q: torch.Tensor | None
                        ) -> list[Proposal]:
        """Each sequence's chain from ``chain``'s drafts, read back (the caller's one wait): its first
        ``num_nodes - 1`` per sequence, with their q rows for a sampled request."""
        n = self.num_nodes - 1
        return [Proposal(DraftTree.chain(w.entry.token_ids[0], row[:n]),
                         None if q is None or w.seq.params.greedy else q[i, :n])
                for i, (w, row) in enumerate(zip(work, rows))]

    def _first_pass(self, work: list[DraftWork]) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over every base not yet in its cache, up to the root; consumes the pending
        aux rows. -> (root-row logits [B, draft_vocab], root-row hidden [B, H])"""
        return self._first_pass_run(*self._first_pass_inputs(work))

    @staticmethod
    def _first_pass_inputs(work: list[DraftWork]) -> tuple[tuple[SeqRows, ...], torch.Tensor]:
        """The first pass's rows (base b reads token b + 1 at RoPE b + 1) and their aux states [rows, 3H]; the
        pending rows are consumed (the bases up to the root count as in the draft cache from here)."""
        inputs: list[SeqRows] = []
        hidden: list[torch.Tensor] = []
        for w in work:
            n, b0 = w.entry.start, w.state.num_bases
            tokens = w.seq.token_ids(b0 + 1, n + 1)
            inputs.append(SeqRows(tuple(w.entry.block_table), tuple(tokens), tuple(range(b0 + 1, n + 1)), n))
            hidden += w.state.pending
            w.state.num_bases, w.state.pending = n, []
        return tuple(inputs), hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def _first_pass_run(self, inputs: tuple[SeqRows, ...], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, out = self._run(list(inputs), hidden)
        last = to_device([r - 1 for r in itertools.accumulate(d.rows for d in inputs)], out.device)
        return logits, out.index_select(0, last)

    def _run(self, seqs: list[SeqRows], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward. hidden: [rows, 3*H_target] or [rows, H] -> (draft-vocab logits fp32
        [sum(num_logits), draft_vocab], next hidden [rows, H])"""
        out = self.draft.run(Step(tuple(seqs)), hidden)
        return out.logits.float(), out.hidden[0]

    def _children(self, builders: list[TreeBuilder], logits: torch.Tensor, parents: list[list[int]]
                  ) -> list[list[int]]:
        """Add the children of every fed node (one logits row each, in order); returns, per
        sequence, the new candidates in order (``topk`` per parent)."""
        top_tokens_t, top_lp = self._top_k(logits)
        # one read-back for tokens and scores (a wait: the draft step must finish); float64 holds any token id
        both = torch.cat([top_tokens_t.double(), top_lp.double()], dim=-1).tolist()
        k = self.topk
        out: list[list[int]] = []
        row = 0
        for i, builder in enumerate(builders):
            new: list[int] = []
            for parent in parents[i]:
                new += builder.add_children(parent, [int(t) for t in both[row][:k]], both[row][k:])
                row += 1
            out.append(new)
        return out

    def _split(self, children: list[list[int]], leaves: list[list[int]]) -> list[list[list[int]]]:
        k = self.topk
        return [[kids[r * k:(r + 1) * k] for r in range(len(leaves[i]))] for i, kids in enumerate(children)]

    @staticmethod
    def _draft_mask(builder: TreeBuilder, feed: list[int], slot_of: dict[int, int], n: int, ctx: int
                    ) -> tuple[bool, ...]:
        """[len(feed), ctx - n] row-major over the scratch slots after the bases (which all stay
        visible): each node's ancestors' slots and its own."""
        width = ctx - n
        mask = [False] * (len(feed) * width)
        for r, c in enumerate(feed):
            a = c
            while a >= 0:
                mask[r * width + slot_of[a] - n] = True
                a = builder.parent(a)
        return tuple(mask)


def draws(work: list[DraftWork], n: int, device: torch.device) -> torch.Tensor:
    """``n`` uniform numbers from each request's stream, on the device: [len(work), n] (one request's a view, no
    stacking kernel)."""
    return (work[0].draw(n)[None] if len(work) == 1 else torch.stack([w.draw(n) for w in work])).to(device)


def draft_temperatures(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """Each request's temperature as a chained replay draws with it (0: the argmax), on the device."""
    return to_device([0.0 if p.greedy else p.temperature for p in params], device, torch.float32)


# A device tree's build in one Triton launch on a GPU (``tree_build_triton``); False: the torch ops (~35 kernels), the
# A/B (bench/graph_launch_probe.py --set worker.spec_decode.drafter.TREE_BUILD_ONE_LAUNCH=False).
TREE_BUILD_ONE_LAUNCH = True


def tree_kernels(device: torch.device) -> TreeKernels | None:
    """A device tree's fused kernels where the hardware runs them (CUDA with Triton): the start and each step's expand
    (``tree_expand_triton``) and the build (``tree_build_triton``; None where ``TREE_BUILD_ONE_LAUNCH`` is off);
    else None (the torch ops)."""
    module = f"{__package__}.tree_expand_triton"
    start, expand = gpu_kernel(device, module, "tree_start_triton"), gpu_kernel(device, module, "tree_expand_triton")
    if start is None or expand is None:
        return None
    build = gpu_kernel(device, f"{__package__}.tree_build_triton", "tree_build_triton") if TREE_BUILD_ONE_LAUNCH else None
    return TreeKernels(start, expand, build)


TopK = Callable[[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (logits, k, table)


def top_k_torch(logits: torch.Tensor, k: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` best log-probabilities (fp32, descending) and their indices through ``table`` (the draft
    vocabulary's target ids)."""
    values, indices = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return values, table[indices]


def top_k_kernel(device: torch.device, vocab: int) -> TopK:
    """The draft's per-row top-k: one Triton kernel where the hardware runs it (CUDA, a vocabulary one
    program holds), else torch's log-softmax and top-k."""
    module = f"{__package__}.topk_logprobs_triton"
    fast, limit = gpu_kernel(device, module, "topk_logprobs_triton"), gpu_kernel(device, module, "MAX_VOCAB")
    if fast is None or limit is None or vocab > limit:
        return top_k_torch
    return cast(TopK, fast)
