"""Forwards at padded static shapes, captured once as CUDA graphs and replayed: the only CUDA-graph code.

``StepGraphs`` captures a forward (``fn(batch) -> ModelOutput``) once per ``StepShape`` at
construction, on static buffers (one int64 buffer for every index, one per hidden width), the
largest shape first into one memory pool; ``run`` packs a step's rows (host lists) into the
buffer with one copy, replays, and returns the real rows of each output. Padding rows write
their K/V to ``pad_slot`` (a slot no sequence is ever given: the executor reserves the cache's
last block) and attend to one slot; their outputs are dropped. Padding sequences of a DP
group that has fewer (or no) sequences than the agreed shape are all padding rows.

Collectives run inside the graph (NCCL, FlashInfer's fused all-reduce). The ledger counts
nothing while a forward is captured (``CollectiveLedger.capture``); every replay adds the
captured forward's plan and records again (``CollectiveLedger.replay``), so planned == executed
holds replay by replay. Under DP attention the captured forward sees every DP group at the
shape's row count (MAX_LEN padding) and the groups' real token counts as a device tensor in the
static buffer, from which the communicator builds the valid-rows mask on the device.

A chained shape (``StepShape.chain``: the EAGLE3 draft's greedy chain) captures ``chain`` forwards
of one row per sequence back to back: after each, ``feed`` turns its logits into the next input
tokens and its hidden output becomes the next hidden input, and positions, causal limits, context
lengths and cache slots advance by one on the device (the next slot through the block table;
padding rows keep writing to ``pad_slot``). Its one output is every forward's fed token,
[rows, chain]. A chain with a first pass (``StepShape.has_first_pass``) runs the draft's first pass over
the packed rows before it: the first pass's draft (from its ``last_only`` logits) and its last rows' hidden
states feed step 1, one row per sequence one position, index, context and slot after the sequence's last
row; its output [batch, 1 + chain] starts with the first pass's draft. A sampled chain
(``StepShape.sampled``) feeds ``sample``'s draw instead, from each sequence's temperature and uniform
numbers (``run``'s ``temperatures`` [seqs], ``uniforms`` [seqs, drafts]; static inputs like the rest),
and also returns the distributions drawn from, [batch, drafts, vocab]. A tree chain
(``StepShape.is_tree_chain``: a draft tree's steps) replays ``grow``,
the drafter's program, which runs the ``chain`` forwards through a hook: before forward j its
``tokens`` leaves per sequence take the program's tokens, hidden inputs and mask rows over the
``j * tokens`` scratch slots (the tail's earlier columns stay visible: bases), at RoPE one further
and ``tokens`` slots further on; its inputs are the first leaves' tokens, scores and hidden inputs
(``run``'s ``input_ids``, ``scores``, ``hidden``), its outputs the built trees (per sequence). A tree chain with a
first pass (both ``has_first_pass`` and ``is_tree_chain``) runs the first pass as a chain's does, then the tree's
steps, ``leaves`` per sequence laid out after each sequence's last real row; its first leaves are ``leaves``'s pick
from the first pass's logits (the drafter's top-k: tokens and scores) fed its last row's hidden state, so the
first pass's rows are all it takes (staged by the verify's program of a tree round in flight).
Every captured forward's attention reads the batch's device metadata alone (a planner's
``graph_plan``), so it follows the contexts growing inside the replay.

A ``finish`` program (a plain forward's: the speculative verify's) runs inside the capture right after
the forward, on the shape's static inputs (``StaticInputs``) and the forward's outputs; what it returns
follows the forward's outputs (``extras``). It may also write another graph's static inputs (the
verify stages the draft's next first pass: ``static_inputs``), which ``replay_staged`` then replays as
they are, with nothing packed or copied by the host.

Off CUDA (``use_graphs=False``: the CPU tests, tp > 1 over gloo too) the same padded
static-buffer forward runs eagerly: "capture" runs it once with the ledger capturing, and every
"replay" runs it again the same way, checks that it ran exactly the captured collectives, and
then replays the ledger as a graph would. Needs graph-safe kernels (``Kernels.graph_safe``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ...models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
from ...models.interface import ModelOutput
from ...models.layers.attention_layout import AttentionPlanner
from ...models.parallel.dp_geometry import Padding
from ...models.parallel.ledger import CapturedForward, CollectiveLedger
from .chain_layout import ChainSteps, FirstPass, chain_steps, first_pass
from .gpu_kernel import gpu_kernel
from .step_shape import ShapeKey, StepShape

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
# A chain's first pass layout and its steps' in one Triton launch on a GPU (``chain_layout_triton``) instead of
# ``chain_layout.first_pass``'s ~25 small torch kernels (the reference and the CPU path). On an H100 the SmolLM2
# chain-7 draft graph takes 213 us against 254 and a round ~3 % less through the engine
# (bench/results/2026-12-06-first-pass-kernel-smollm2-h100.json; the A/B: bench/graph_launch_probe.py --set
# worker.executor.step_graphs.FIRST_PASS_KERNEL=False).
FIRST_PASS_KERNEL = True
StepFn = Callable[[ForwardBatch], ModelOutput]
FeedFn = Callable[[torch.Tensor], torch.Tensor]  # a chained forward's logits [rows, vocab] -> next tokens [rows]
# a tree chain's forward j: (j, leaf tokens [rows], hidden [rows, H], mask rows [rows, j * tokens]) -> (logits, hidden)
TreeForward = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# a tree chain's program: (forward, first leaves' tokens [B, k], scores [B, k], hidden [B, k, H]) -> per-sequence outputs
GrowFn = Callable[[TreeForward, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# a first pass's pick of a tree's first leaves: (its last rows' logits [batch, vocab]) -> (tokens, scores) [batch, leaves]
LeavesFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# a sampled chain's draw: (logits [rows, vocab], temperatures [rows] (0: argmax), uniforms [rows]) -> (tokens, q)
SampleFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StaticInputs:
    """A captured shape's static inputs on the device, as its replays read them (real sequences first, then
    padding: padding rows write ``pad_slot``)."""

    ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows] RoPE positions
    slots: torch.Tensor  # [rows] cache slots
    index: torch.Tensor  # [rows] each row's index in its sequence's context
    context_lens: torch.Tensor  # [batch]
    tables: torch.Tensor  # [batch, max_blocks]
    hidden: torch.Tensor | None  # [rows, hidden]: a hidden input's
    drop: torch.Tensor | None  # [batch]: a first pass's rows that are not real after all
    pad_slot: int
    block_size: int = 0  # the cache's (0: not given; a program then stages no slots of its own)
    tail: torch.Tensor | None = None  # [rows, tail] 0/1: a tree's masks over each context's last slots


# a plain forward's finish program: (shape, its static inputs, the forward's output) -> extra outputs
FinishFn = Callable[[StepShape, StaticInputs, ModelOutput], tuple[torch.Tensor, ...]]


class GraphReplayMismatch(RuntimeError):
    """An eager "replay" ran other collectives than its shape's capture: a graph would be wrong."""


@dataclass(frozen=True)
class PackedSeq:
    """One sequence's rows as ``run`` takes them: they fill the last ``len(token_ids)`` slots of
    ``context_len``."""

    block_table: Sequence[int]
    token_ids: Sequence[int]
    positions: Sequence[int]  # RoPE positions
    slots: Sequence[int]  # cache slot of each row
    context_len: int
    tail_mask: Sequence[bool] | None = None  # [rows, tail] row-major; None = causal


@dataclass
class _Views:
    """One shape's static inputs: views of the shared buffers at that shape's offsets."""

    ids: torch.Tensor  # [rows]
    positions: torch.Tensor
    slots: torch.Tensor
    index: torch.Tensor  # each row's index in its sequence's context (causal limit)
    dest: torch.Tensor  # [rows] the packed row of each real row (real rows first)
    context_lens: torch.Tensor  # [batch]
    tables: torch.Tensor  # [batch, max_blocks]
    tail: torch.Tensor  # [rows, tail] 0/1
    dp_real: torch.Tensor | None  # [dp] real tokens of every DP group
    token_seq: torch.Tensor  # [rows] constant
    query_start: torch.Tensor  # [batch + 1] constant: each sequence's first row (int32)
    last_rows: torch.Tensor  # [batch] constant: each sequence's last row
    hidden: torch.Tensor | None  # [rows, hidden]
    scores: torch.Tensor | None  # [rows] float64: a tree chain's first leaves' scores
    temperatures: torch.Tensor | None  # [batch] float32: a sampled chain's (0: argmax)
    uniforms: torch.Tensor | None  # [batch, drafts] float64: a sampled chain's numbers, one per draft it draws
    drop: torch.Tensor | None  # [batch] a first pass's rows that are not real after all (``run``'s drop; packed 0)
    one_row_seq: torch.Tensor | None  # [batch] constant: the chain's rows after a first pass, one per sequence
    one_row_start: torch.Tensor | None  # [batch + 1] constant (int32)
    pass_rows: torch.Tensor | None  # [tokens] constant: arange(tokens), a first pass's rows of a sequence
    leaf_seq: torch.Tensor | None  # [batch * leaves] constant: a tree's steps after a first pass, each row's sequence
    leaf_start: torch.Tensor | None  # [batch + 1] constant (int32): their first rows


@dataclass(frozen=True)
class _HostLayout:
    """A shape's numpy views of the pinned host buffer (laid out as ``_Views`` lays out ``_meta``), and the
    host tensor's and ``_meta``'s slices the step's copy goes between."""

    buf: np.ndarray
    ids: np.ndarray
    pos: np.ndarray
    slots: np.ndarray
    index: np.ndarray
    dest: np.ndarray
    ctx: np.ndarray
    tables: np.ndarray
    masks: np.ndarray | None
    dp_real: np.ndarray | None
    host: torch.Tensor
    meta: torch.Tensor


@dataclass
class _Captured:
    views: _Views
    graph: Any  # torch.cuda.CUDAGraph; None when running eagerly
    outputs: tuple[torch.Tensor, ...]
    forward: CapturedForward
    attention: Any  # the attention backend's plan of captured forwards (None: it needs none)


class StepGraphs:
    """``aux_layers``: what the forwards return besides logits (``ForwardBatch.aux_layers``);
    ``dp``: the number of DP-attention groups (0 = no DP attention)."""

    def __init__(self, fn: StepFn, kv_cache: KVCache, shapes: Sequence[StepShape], max_blocks: int,
                 hidden_dtype: torch.dtype, ledger: CollectiveLedger | None = None,
                 aux_layers: tuple[int, ...] = (), dp: int = 0, use_graphs: bool | None = None,
                 attention: AttentionPlanner | None = None, feed: FeedFn | None = None,
                 grow: GrowFn | None = None, sample: SampleFn | None = None, finish: FinishFn | None = None,
                 leaves: LeavesFn | None = None) -> None:
        if not shapes:
            raise ValueError("no step shapes to capture")
        for shape in shapes:
            program = grow if shape.is_tree_chain else sample if shape.sampled else feed
            if shape.chain and (program is None or dp):
                raise ValueError(f"{shape}: a chained forward needs a feed (a sampled chain's: a draw; a tree's: a "
                                 f"program) and no DP attention")
            if shape.is_tree_chain and shape.has_first_pass and leaves is None:
                raise ValueError(f"{shape}: a tree chain after a first pass needs its first leaves' pick (leaves)")
        self.feed = feed
        self.leaves = leaves
        self.finish = finish
        self.sample = sample
        self.grow = grow
        self.fn = fn
        self.kv_cache = kv_cache
        self.max_blocks = max_blocks
        self.ledger = ledger if ledger is not None else CollectiveLedger()
        self.aux_layers = aux_layers
        self.dp = dp
        self.attention = attention
        self.pad_slot = kv_cache.num_blocks * kv_cache.block_size - 1
        device = next(iter(kv_cache.k.values())).device
        self.device = device
        fused = gpu_kernel(device, f"{__package__}.chain_layout_triton", "first_pass_triton")
        self.first_pass: Callable[..., FirstPass] = fused if FIRST_PASS_KERNEL and fused is not None else first_pass
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its KV cache on a CUDA device")
        ordered = sorted(set(shapes), key=lambda s: (s.rows, s.tail, s.batch), reverse=True)
        meta_size = max(self._layout_size(s) for s in ordered)
        self._meta = torch.zeros(meta_size, dtype=torch.long, device=device)
        # The host twin of _meta that each step is packed into (pinned on CUDA: an asynchronous copy).
        self._host_t = torch.zeros(meta_size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host = self._host_t.numpy()
        # The last copy out of the pinned buffer: the next packing waits for it (a follower rank never
        # reads its outputs, so nothing else would hold its host back from its stream).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._hidden = {h: torch.zeros(max(s.rows for s in ordered if s.hidden == h), h, dtype=hidden_dtype,
                                       device=device) for h in {s.hidden for s in ordered if s.hidden}}
        trees = [s.rows for s in ordered if s.is_tree_chain]
        self._scores = torch.zeros(max(trees), dtype=torch.float64, device=device) if trees else None
        drawn = [s for s in ordered if s.sampled]
        self._temperatures = torch.zeros(max(s.batch for s in drawn), device=device) if drawn else None
        self._uniforms = (torch.zeros(max(s.batch for s in drawn), max(_drafts(s) for s in drawn), dtype=torch.float64,
                                      device=device) if drawn else None)
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.captured: dict[StepShape, _Captured] = {}
        self.extras: dict[StepShape, int] = {}  # outputs the finish program added, per shape
        self._layouts: dict[StepShape, _HostLayout] = {}
        self.runs = 0  # steps run through here (replays, or the padded forward off CUDA)
        self.batch_sizes: dict[ShapeKey, list[int]] = {}
        with torch.inference_mode(), _no_collection():
            for shape in ordered:
                self.captured[shape] = self._capture(shape)
        for s in sorted(self.captured):
            self.batch_sizes.setdefault(s.key, []).append(s.batch)

    def shape_for(self, num_seqs: int, key: ShapeKey) -> StepShape | None:
        """The captured shape a step of ``num_seqs`` sequences with this key runs at; None = none fits."""
        b = next((b for b in self.batch_sizes.get(key, ()) if b >= num_seqs), None)
        return None if b is None else StepShape.of(b, key)

    def first_pass_key(self, max_rows: int, hidden: int, chain: int = 0, sampled: bool = False) -> ShapeKey | None:
        """The captured ``last_only`` key that holds ``max_rows`` rows per sequence, if any (with ``chain``:
        a first pass and that many chained steps, drawn when ``sampled``)."""
        keys = sorted(k for k in self.batch_sizes
                      if k[2] and not k[1] and k[3] == hidden and k[0] >= max_rows and k[4] == chain and k[5] == sampled)
        return keys[0] if keys else None

    # --- capture ----------------------------------------------------------------------------

    def _layout_size(self, shape: StepShape) -> int:
        t = shape.rows
        drop = shape.batch if shape.has_first_pass else 0
        return 5 * t + shape.batch * (1 + self.max_blocks) + t * shape.tail + drop + self.dp

    def _views(self, shape: StepShape) -> _Views:
        t, b, m = shape.rows, shape.batch, self.max_blocks
        drop = b if shape.has_first_pass else 0
        parts = self._meta[: self._layout_size(shape)].split([t, t, t, t, t, b, b * m, t * shape.tail, drop, self.dp])
        dev = self.device
        q = shape.tokens
        tree_first = shape.has_first_pass and shape.is_tree_chain
        return _Views(ids=parts[0], positions=parts[1], slots=parts[2], index=parts[3], dest=parts[4],
                      context_lens=parts[5], tables=parts[6].view(b, m), tail=parts[7].view(t, shape.tail),
                      dp_real=parts[9] if self.dp else None, drop=parts[8] if drop else None,
                      token_seq=torch.arange(b, device=dev).repeat_interleave(q),
                      query_start=torch.arange(b + 1, dtype=torch.int32, device=dev) * q,
                      last_rows=torch.arange(b, device=dev) * q + q - 1,
                      hidden=self._hidden[shape.hidden][:t] if shape.hidden else None,
                      scores=self._scores[:t] if shape.is_tree_chain and self._scores is not None else None,
                      temperatures=self._temperatures[:b] if shape.sampled and self._temperatures is not None else None,
                      uniforms=(self._uniforms[:b, :_drafts(shape)] if shape.sampled and self._uniforms is not None
                                else None),
                      one_row_seq=torch.arange(b, device=dev) if shape.has_first_pass else None,
                      one_row_start=torch.arange(b + 1, dtype=torch.int32, device=dev) if shape.has_first_pass else None,
                      pass_rows=torch.arange(q, device=dev) if shape.has_first_pass else None,
                      leaf_seq=torch.arange(b, device=dev).repeat_interleave(shape.leaves) if tree_first else None,
                      leaf_start=(torch.arange(b + 1, dtype=torch.int32, device=dev) * shape.leaves if tree_first
                                  else None))

    def _forward(self, shape: StepShape, v: _Views, attention: Any = None) -> tuple[torch.Tensor, ...]:
        """The padded forward on the static views (captured: everything here is replayed)."""
        b = shape.batch
        tail = (v.tail != 0) if shape.tail and not shape.has_first_pass else None  # (after one: its own)
        meta = PagedAttentionMetadata(block_tables=v.tables, context_lens=v.context_lens, token_seq=v.token_seq,
                                      token_index=v.index, query_start=v.query_start,
                                      max_query_len=shape.tokens, tail_mask=tail)
        batch = ForwardBatch(
            input_ids=v.ids, positions=v.positions,
            # The lists are not read by graph-safe kernels; they describe the padded shape only.
            query_lens=[shape.tokens] * b, context_lens=[shape.tokens] * b, slot_mapping=v.slots,
            block_tables=[[0]] * b, kv_cache=self.kv_cache,
            logits_indices=v.last_rows if shape.last_only else None, paged=meta,
            dp_num_tokens=[shape.rows] * self.dp if self.dp else None,
            dp_padding=Padding.MAX_LEN if self.dp else None, dp_real_tokens=v.dp_real,
            aux_layers=self.aux_layers, input_hidden=v.hidden, attention=attention)
        if not shape.chain:
            out = self.fn(batch)
            extra = () if self.finish is None else self.finish(shape, self._static(v), out)
            self.extras[shape] = len(extra)
            return (out.logits, *out.hidden, *extra)
        if shape.is_tree_chain and not shape.has_first_pass:
            assert tail is not None
            return self._tree_chain(shape, v, batch, tail)
        fed: list[torch.Tensor] = []
        drawn_from: list[torch.Tensor] = []

        def draw(logits: torch.Tensor) -> torch.Tensor:
            if shape.sampled:
                assert self.sample is not None and v.temperatures is not None and v.uniforms is not None
                token, q = self.sample(logits, v.temperatures, v.uniforms[:, len(fed)])
                drawn_from.append(q)
            else:
                assert self.feed is not None
                token = self.feed(logits)
            fed.append(token)
            return token

        assert v.hidden is not None
        if shape.has_first_pass:  # the first pass, then one row per sequence after each one's last row
            assert v.one_row_seq is not None and v.one_row_start is not None and batch.paged is not None
            assert v.drop is not None and v.pass_rows is not None
            # each sequence's last ``drop`` rows are not real: its rows shift to the end, its front rows all
            # copies of its first real row (the same K/V to the same slot, outputs dropped)
            args = (v.ids, v.positions, v.slots, v.index, v.context_lens, v.hidden, v.drop, v.tables, shape.tokens,
                    shape.chain, self.kv_cache.block_size, self.pad_slot, (v.pass_rows, v.one_row_seq, v.last_rows))
            fp = self.first_pass(*args, leaves=shape.leaves)  # (a tree's steps after it: several leaves a sequence)
            batch = replace(batch, input_ids=fp.ids, positions=fp.positions, slot_mapping=fp.slots,
                            input_hidden=fp.hidden, paged=replace(batch.paged, context_lens=fp.context_lens,
                                                                  token_index=fp.index, tail_mask=None))
            assert batch.paged is not None
            first = self.fn(batch)
            if shape.is_tree_chain:
                return self._tree_after_first(shape, v, batch, fp.steps, first)
            ids, hidden = draw(first.logits), first.hidden[0].index_select(0, v.last_rows)
            one_row = replace(batch, query_lens=[1] * b, context_lens=[1] * b, logits_indices=None,
                              paged=replace(batch.paged, token_seq=v.one_row_seq, query_start=v.one_row_start,
                                            max_query_len=1))
            step = self._steps(fp.steps, one_row)
        else:
            ids, hidden = v.ids, v.hidden
            step = self._chain_steps(b, shape.tokens, shape.chain, v.positions, v.index, v.context_lens, v.slots,
                                     v.tables, batch)
        for j in range(1, shape.chain + 1):
            out = self.fn(step(j, ids, hidden))
            ids, hidden = draw(out.logits), out.hidden[0]
        if shape.sampled:
            return torch.stack(fed, dim=1), torch.stack(drawn_from, dim=1)
        return (torch.stack(fed, dim=1),)

    def _chain_steps(self, b: int, q: int, chain: int, positions: torch.Tensor, index: torch.Tensor,
                     context_lens: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, batch: ForwardBatch
                     ) -> Callable[[int, torch.Tensor, torch.Tensor], ForwardBatch]:
        """Forward j (1 .. chain) of a chained shape (``b`` sequences of ``q`` rows), fed these token ids and
        hidden inputs: its rows one RoPE position and ``q`` slots further per step than step 1's layout
        (``positions``, causal limits ``index`` and ``slots`` [b * q], ``context_lens`` [b], the block
        ``tables``; ``batch`` the step's template); every step's positions, causal limits, context lengths and
        cache slots made at once (padding rows keep ``pad_slot``)."""
        return self._steps(chain_steps(b, q, chain, positions, index, context_lens, slots, tables,
                                       self.kv_cache.block_size, self.pad_slot), batch)

    @staticmethod
    def _steps(steps: ChainSteps, batch: ForwardBatch) -> Callable[[int, torch.Tensor, torch.Tensor], ForwardBatch]:
        """Forward j's batch: ``batch`` at row j - 1 of ``steps``, fed these token ids and hidden inputs."""
        assert batch.paged is not None
        paged = batch.paged

        def step(j: int, ids: torch.Tensor, hidden: torch.Tensor) -> ForwardBatch:
            meta = replace(paged, context_lens=steps.context_lens[j - 1], token_index=steps.index[j - 1])
            return replace(batch, input_ids=ids, positions=steps.positions[j - 1], slot_mapping=steps.slots[j - 1],
                           input_hidden=hidden, paged=meta)

        return step

    def _tree_chain(self, shape: StepShape, v: _Views, batch: ForwardBatch, tail: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
        """A draft tree's ``chain`` steps: the program's forwards (``_chain_steps``), each writing its own
        columns of ``tail``, the attention's mask (bool [rows, shape.tail])."""
        b, k = shape.batch, shape.tokens
        assert self.grow is not None and v.hidden is not None and v.scores is not None
        step = self._chain_steps(b, k, shape.chain, v.positions, v.index, v.context_lens, v.slots, v.tables, batch)
        return self.grow(self._tree_forward(step, tail, k), v.ids.view(b, k), v.scores.view(b, k),
                         v.hidden.view(b, k, -1))

    def _tree_forward(self, step: Callable[[int, torch.Tensor, torch.Tensor], ForwardBatch], tail: torch.Tensor,
                      leaves: int) -> TreeForward:
        """The grow program's forward j: its ``leaves`` rows per sequence (``step``'s batch j) with their mask rows
        written into the last ``j * leaves`` columns of ``tail`` (the earlier columns: bases, visible)."""
        width = tail.shape[1]

        def forward(j: int, ids: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            tail[:, width - j * leaves:].copy_(rows)
            out = self.fn(step(j, ids, hidden))
            return out.logits, out.hidden[0]

        return forward

    def _tree_after_first(self, shape: StepShape, v: _Views, batch: ForwardBatch, steps: ChainSteps,
                          first: ModelOutput) -> tuple[torch.Tensor, ...]:
        """A tree chain after its first pass (``first``: its last rows' logits, every row's hidden output): the
        first leaves are ``leaves``'s pick from the logits, fed the last row's hidden state; then the program's
        forwards as ``_tree_chain``'s, ``leaves`` rows per sequence laid out by ``steps``."""
        b, k, width = shape.batch, shape.leaves, shape.tail
        assert self.grow is not None and self.leaves is not None and batch.paged is not None
        assert v.leaf_seq is not None and v.leaf_start is not None
        tail = torch.ones((b * k, width), dtype=torch.bool, device=self.device)  # the earlier columns: bases
        leaf_batch = replace(batch, query_lens=[k] * b, context_lens=[k] * b, logits_indices=None,
                             paged=replace(batch.paged, token_seq=v.leaf_seq, query_start=v.leaf_start, max_query_len=k,
                                           tail_mask=tail))
        tokens, scores = self.leaves(first.logits)
        hidden = first.hidden[0].index_select(0, v.last_rows)
        return self.grow(self._tree_forward(self._steps(steps, leaf_batch), tail, k), tokens, scores,
                         hidden[:, None, :].expand(b, k, hidden.shape[-1]))

    def _capture(self, shape: StepShape) -> _Captured:
        views = self._views(shape)
        packed = self._packed(shape, [], [0] * self.dp)
        packed.meta.copy_(packed.host)  # synchronous
        attention = None if self.attention is None else self.attention.graph_plan()
        if not self.use_graphs:
            with self.ledger.capture() as forward:
                self._forward(shape, views, attention)
            return _Captured(views, None, (), forward, attention)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):  # these really run: their collectives stay in the ledger
                self._forward(shape, views, attention)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with self.ledger.capture() as forward, torch.cuda.graph(graph, pool=self._pool):
            outputs = self._forward(shape, views, attention)
        log.debug("captured %s (%d collectives)", shape, len(forward.records))
        return _Captured(views, graph, outputs, forward, attention)

    # --- replay -----------------------------------------------------------------------------

    def pad_inputs(self, shape: StepShape) -> None:
        """Fill ``shape``'s static inputs with padding rows only, as at its capture (every row writes the pad
        slot, every index stays in range): what a bench needs before replaying a graph on its own (the
        buffers hold whatever the last step of another shape packed)."""
        packed = self._packed(shape, [], [0] * self.dp)
        packed.meta.copy_(packed.host)
        if self._copied is not None:
            self._copied.record()

    def _static(self, v: _Views) -> StaticInputs:
        return StaticInputs(v.ids, v.positions, v.slots, v.index, v.context_lens, v.tables, v.hidden, v.drop,
                            self.pad_slot, self.kv_cache.block_size, v.tail if v.tail.shape[1] else None)

    def static_inputs(self, shape: StepShape) -> StaticInputs:
        """``shape``'s static inputs, for another graph's program to stage a replay of it (``replay_staged``)."""
        return self._static(self.captured[shape].views)

    def replay_staged(self, shape: StepShape, sampling: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, ...]:
        """Replay ``shape`` on its static inputs as they stand (staged on the device by another graph's
        program, e.g. the verify's: nothing packed here) -> its outputs at the padded batch. ``sampling``: a
        sampled chain's temperatures [n] and uniform numbers [n, drafts] for its first ``n`` sequences, copied
        in first."""
        entry = self.captured[shape]
        if sampling is not None:
            v = entry.views
            if v.temperatures is None or v.uniforms is None:
                raise ValueError(f"{shape} is not a sampled chain")
            temperatures, uniforms = sampling
            v.temperatures[:temperatures.shape[0]].copy_(temperatures)
            v.uniforms[:uniforms.shape[0]].copy_(uniforms)
        self.runs += 1
        if entry.graph is None:
            with self.ledger.capture() as again:
                outputs = self._forward(shape, entry.views, entry.attention)
            if [r.key for r in again.records] != [r.key for r in entry.forward.records]:
                raise GraphReplayMismatch(f"{shape}: ran {[r.key for r in again.records]}, captured "
                                          f"{[r.key for r in entry.forward.records]}")
        else:
            entry.graph.replay()
            outputs = entry.outputs
        self.ledger.replay(entry.forward)
        return outputs

    def _host_layout(self, shape: StepShape) -> _HostLayout:
        """``shape``'s parts of the pinned host buffer and of ``_meta``, made once per shape."""
        layout = self._layouts.get(shape)
        if layout is None:
            t, b, m, tail = shape.rows, shape.batch, self.max_blocks, shape.tail
            size = self._layout_size(shape)
            buf = self._host[:size]
            at = 5 * t + b + b * m
            ids, pos, slots, index, dest = (buf[i * t:(i + 1) * t] for i in range(5))
            layout = _HostLayout(buf, ids, pos, slots, index, dest, buf[5 * t:5 * t + b], buf[5 * t + b:at].reshape(b, m),
                                 buf[at:at + t * tail].reshape(t, tail) if tail else None,
                                 buf[size - self.dp:size] if self.dp else None, self._host_t[:size], self._meta[:size])
            self._layouts[shape] = layout
        return layout

    def _packed(self, shape: StepShape, seqs: Sequence[PackedSeq], dp_real: Sequence[int],
                host_masks: bool = True) -> _HostLayout:
        """The shape's int64 layout on the host (one pinned buffer, numpy views made once per shape: a step's
        host cost follows its real rows, not the captured width): real sequences first, then padding.
        ``host_masks``: pack the sequences' tail masks (not when the device's replace them)."""
        q = shape.tokens
        if self._copied is not None:
            self._copied.synchronize()
        lay = self._host_layout(shape)
        lay.buf[:] = 0
        ids, pos, slots, index, dest, ctx, tables, masks = (lay.ids, lay.pos, lay.slots, lay.index, lay.dest, lay.ctx,
                                                            lay.tables, lay.masks)
        slots[:] = self.pad_slot
        ctx[:] = 1
        if masks is not None:
            masks[:] = 1
        real = 0
        for i, s in enumerate(seqs):
            k = len(s.token_ids)
            lo, hi = i * q + q - k, i * q + q
            first = s.context_len - k
            ids[lo:hi] = s.token_ids
            pos[lo:hi] = s.positions
            slots[lo:hi] = s.slots
            index[i * q:lo] = first
            index[lo:hi] = np.arange(first, s.context_len)
            dest[real:real + k] = np.arange(lo, hi)
            real += k
            ctx[i] = s.context_len
            tables[i, :len(s.block_table)] = s.block_table
            if masks is not None and s.tail_mask is not None and host_masks:
                masks[lo:hi] = np.asarray(s.tail_mask, dtype=np.int64).reshape(k, shape.tail)
        if lay.dp_real is not None:
            lay.dp_real[:] = dp_real
        return lay

    def run(self, shape: StepShape, seqs: Sequence[PackedSeq], hidden: torch.Tensor | None = None,
            dp_real: Sequence[int] = (), input_ids: torch.Tensor | None = None,
            positions: torch.Tensor | None = None, tail_rows: torch.Tensor | None = None,
            scores: torch.Tensor | None = None, temperatures: torch.Tensor | None = None,
            uniforms: torch.Tensor | None = None, drop: torch.Tensor | None = None,
            later_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One step at ``shape`` (from ``shape_for``) -> each output's real rows, in ``seqs`` order:
        a per-row output [real rows, ...], a per-sequence one (``last_only`` logits) [len(seqs), ...].
        hidden: [real rows, shape.hidden] (the draft's hidden input) or None; dp_real: every DP
        group's real tokens (DP attention); input_ids, positions: [real rows], tail_rows: [real rows,
        shape.tail] (0/1), on the device, in place of the rows' token ids, RoPE positions and tail
        masks (drafts and draft trees grown on the device; the host's values only size the step);
        scores: [real rows] (a tree chain's first leaves' scores); temperatures [len(seqs)], uniforms
        [len(seqs), drafts] (a sampled chain's: one number per draft it draws); drop: [len(seqs)] on the
        device, how many of each sequence's last rows are not real after all (a chain with a first pass, its
        sequences packed with all their rows: the replay shifts the real ones to the end); later_ids:
        [len(seqs), tokens - 1] on the device, the token ids of every sequence's rows after its first (each
        sequence brings ``tokens`` rows: a verify's drafts after its root)."""
        entry = self.captured[shape]
        v = entry.views
        if len(seqs) > shape.batch:
            raise ValueError(f"{len(seqs)} sequences exceed the captured batch of {shape}")
        for s in seqs:
            if len(s.block_table) > self.max_blocks:
                raise ValueError(f"a block table of {len(s.block_table)} blocks exceeds the captured {self.max_blocks}")
        if len(dp_real) != self.dp:
            raise ValueError(f"{len(dp_real)} DP token counts for {self.dp} DP groups")
        packed = self._packed(shape, seqs, dp_real, host_masks=tail_rows is None)
        packed.meta.copy_(packed.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        num_real = sum(len(s.token_ids) for s in seqs)
        dest = v.dest[:num_real]
        if input_ids is not None:
            v.ids.index_copy_(0, dest, _as(input_ids, v.ids))
        if later_ids is not None:
            if later_ids.shape != (len(seqs), shape.tokens - 1) or num_real != len(seqs) * shape.tokens:
                raise ValueError(f"later ids {tuple(later_ids.shape)} for {len(seqs)} sequences of {shape}")
            v.ids.view(shape.batch, shape.tokens)[:len(seqs), 1:].copy_(later_ids)
        if positions is not None:
            v.positions.index_copy_(0, dest, _as(positions, v.positions))
        if tail_rows is not None:
            if tail_rows.shape != (num_real, shape.tail):
                raise ValueError(f"tail rows {tuple(tail_rows.shape)} for {num_real} rows of {shape}")
            v.tail.index_copy_(0, dest, _as(tail_rows, v.tail))
        if v.hidden is not None:
            if hidden is None:
                raise ValueError(f"{shape} takes a hidden input")
            v.hidden.index_copy_(0, dest, _as(hidden, v.hidden))
        if v.scores is not None:
            if scores is None or input_ids is None:
                raise ValueError(f"{shape} takes its first leaves' tokens and scores")
            v.scores.index_copy_(0, dest, _as(scores, v.scores))
        if (v.temperatures is None) != (temperatures is None or uniforms is None):
            raise ValueError(f"{shape}: a sampled chain, and only one, takes temperatures and uniform numbers")
        if v.temperatures is not None and v.uniforms is not None:
            assert temperatures is not None and uniforms is not None
            v.temperatures[:len(seqs)].copy_(temperatures)
            v.uniforms[:len(seqs)].copy_(uniforms)
        if drop is not None:
            if v.drop is None or not all(len(s.token_ids) == shape.tokens for s in seqs):
                raise ValueError(f"{shape}: rows are dropped from a first pass's full sequences only")
            v.drop[:len(seqs)].copy_(drop)
        outputs = self.replay_staged(shape)
        n = len(seqs)
        uniform = all(len(s.token_ids) == shape.tokens for s in seqs)
        out: list[torch.Tensor] = []
        for t in outputs:
            if t.shape[0] == shape.rows:
                out.append(t[:num_real] if uniform else t.index_select(0, dest))
            else:  # one row per sequence
                out.append(t[:n])
        return out


def _as(values: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``values`` in ``buffer``'s dtype (itself when it is: no dispatch on the host's per-step path)."""
    return values if values.dtype == buffer.dtype else values.to(buffer.dtype)


def _drafts(shape: StepShape) -> int:
    """The drafts a chained shape draws per sequence: one per chained step, and the first pass's."""
    return shape.chain + shape.has_first_pass


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector held off while graphs are captured, after one collection first:
    objects of an earlier engine that only a collection frees (its graphs, events, pinned buffers) would
    otherwise be destroyed in the middle of a capture, and their CUDA calls there invalidate it
    ("operation failed due to a previous error during capture": seen once on the H200 in a test that builds
    engines one after another, 2026-12-04-gpu-tests-draft-ahead-h200.json)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
