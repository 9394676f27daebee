"""Engine forwards at padded static shapes, captured once as CUDA graphs and replayed.

A ``StepShape`` is a padded layout: ``batch`` sequences of ``tokens`` rows each (``rows =
batch * tokens``), causal or with a mask over each context's last ``tail`` slots (a draft
tree), logits of every row or of each sequence's last row only (``last_only``: a sequence may
bring fewer rows than ``tokens``, padded in front, e.g. the draft's first pass), and, for the
EAGLE3 draft, a ``hidden`` input of that width. Examples (chain of 3 drafts, batch padded to 8):

    StepShape(8, 1)                          target decode: one token per sequence
    StepShape(8, 4)                          target verify of a chain (root + 3 drafts, causal)
    StepShape(8, 8, tail=8)                  target verify of an 8-node tree (tree mask)
    StepShape(8, 4, last_only=True, hidden=384)  draft first pass: <= 4 bases, aux states in
    StepShape(8, 1, hidden=128)              draft step of a chain: its own hidden state in

``StepGraphs`` captures its forward (``fn(batch, hidden) -> outputs``) once per shape at
construction on static buffers (one int64 buffer for every index, one per hidden width), the
largest shape first into one memory pool; ``run`` packs a step's rows (``StepRows``, host lists)
into the buffer with one copy, replays and returns the real rows of each output. Padding rows
write their K/V to ``pad_slot`` (a slot no sequence is ever given: the engine reserves the
cache's last block) and attend to one slot of their own sequence; their outputs are dropped.

Collectives run inside the graph; the ledger records made while capturing are added to the
ledger at every replay (``CollectiveLedger.replay``), so executed == planned still holds.
``use_graphs=False`` (off CUDA) runs the same padded static-buffer forward eagerly: the CPU
tests check the packing with it. Needs graph-safe kernels (``paged_attention_torch``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
from ..models.parallel.collectives import Collectives
from ..models.parallel.ledger import CollectiveLedger, CollectiveRecord

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
StepFn = Callable[[ForwardBatch, "torch.Tensor | None"], tuple[torch.Tensor, ...]]


@dataclass(frozen=True, order=True)
class StepShape:
    batch: int  # padded sequences
    tokens: int  # rows per sequence
    tail: int = 0  # mask over each context's last ``tail`` slots; 0 = causal
    last_only: bool = False  # logits of each sequence's last row; fewer rows padded in front
    hidden: int = 0  # width of the hidden-state input (EAGLE3 draft); 0 = none

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


@dataclass(frozen=True)
class StepRows:
    """One sequence's new rows: they fill the last ``len(token_ids)`` slots of ``context_len``."""

    block_table: list[int]
    token_ids: list[int]
    positions: list[int]  # RoPE positions
    slots: list[int]  # cache slot of each row
    context_len: int
    tail_mask: list[bool] | None = None  # [rows, tail] row-major; None = causal


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
    token_seq: torch.Tensor  # [rows] constant
    last_rows: torch.Tensor  # [batch] constant: each sequence's last row
    hidden: torch.Tensor | None  # [rows, hidden]


@dataclass
class _Captured:
    views: _Views
    graph: Any  # torch.cuda.CUDAGraph; None when running eagerly
    outputs: tuple[torch.Tensor, ...]
    records: list[CollectiveRecord]


def _layout_size(shape: StepShape, max_blocks: int) -> int:
    return 5 * shape.rows + shape.batch * (1 + max_blocks) + shape.rows * shape.tail


class StepGraphs:
    def __init__(self, fn: StepFn, kv_cache: KVCache, shapes: Sequence[StepShape], max_blocks: int,
                 hidden_dtype: torch.dtype, collectives: Collectives | None = None,
                 use_graphs: bool | None = None) -> None:
        if not shapes:
            raise ValueError("no step shapes to capture")
        self.fn = fn
        self.kv_cache = kv_cache
        self.max_blocks = max_blocks
        self.collectives = collectives
        self.pad_slot = kv_cache.num_blocks * kv_cache.block_size - 1
        device = next(iter(kv_cache.k.values())).device
        self.device = device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its KV cache on a CUDA device")
        ordered = sorted(set(shapes), key=lambda s: (s.rows, s.tail, s.batch), reverse=True)
        self._meta = torch.zeros(max(_layout_size(s, max_blocks) for s in ordered), dtype=torch.long, device=device)
        self._hidden = {h: torch.zeros(max(s.rows for s in ordered if s.hidden == h), h, dtype=hidden_dtype,
                                       device=device) for h in {s.hidden for s in ordered if s.hidden}}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.captured: dict[StepShape, _Captured] = {}
        self.runs = 0  # steps run through here (replays, or the padded forward off CUDA)
        self.batch_sizes: dict[tuple[int, int, bool, int], list[int]] = {}
        with torch.inference_mode():
            for shape in ordered:
                self.captured[shape] = self._capture(shape)
        for s in sorted(self.captured):
            self.batch_sizes.setdefault((s.tokens, s.tail, s.last_only, s.hidden), []).append(s.batch)

    def shape_for(self, num_seqs: int, tokens: int, tail: int = 0, last_only: bool = False,
                  hidden: int = 0) -> StepShape | None:
        """The captured shape a step of ``num_seqs`` sequences runs at; None = none fits (eager)."""
        sizes = self.batch_sizes.get((tokens, tail, last_only, hidden), ())
        b = next((b for b in sizes if b >= num_seqs), None)
        return None if b is None else StepShape(b, tokens, tail, last_only, hidden)

    # --- capture ----------------------------------------------------------------------------

    def _views(self, shape: StepShape) -> _Views:
        t, b, m = shape.rows, shape.batch, self.max_blocks
        parts = self._meta[: _layout_size(shape, m)].split([t, t, t, t, t, b, b * m, t * shape.tail])
        dev = self.device
        q = shape.tokens
        return _Views(ids=parts[0], positions=parts[1], slots=parts[2], index=parts[3], dest=parts[4],
                      context_lens=parts[5], tables=parts[6].view(b, m), tail=parts[7].view(t, shape.tail),
                      token_seq=torch.arange(b, device=dev).repeat_interleave(q),
                      last_rows=torch.arange(b, device=dev) * q + q - 1,
                      hidden=self._hidden[shape.hidden][:t] if shape.hidden else None)

    def _forward(self, shape: StepShape, v: _Views) -> tuple[torch.Tensor, ...]:
        """The padded forward on the static views (captured: everything here is replayed)."""
        b = shape.batch
        meta = PagedAttentionMetadata(block_tables=v.tables, context_lens=v.context_lens, token_seq=v.token_seq,
                                      token_index=v.index, max_query_len=shape.tokens,
                                      tail_mask=(v.tail != 0) if shape.tail else None)
        batch = ForwardBatch(
            input_ids=v.ids, positions=v.positions,
            # The lists are not read by graph-safe kernels; they describe the padded shape only.
            query_lens=[shape.tokens] * b, context_lens=[shape.tokens] * b, slot_mapping=v.slots,
            block_tables=[[0]] * b, kv_cache=self.kv_cache,
            logits_indices=v.last_rows if shape.last_only else None, paged=meta)
        return self.fn(batch, v.hidden)

    def _pack_padding(self, shape: StepShape) -> None:
        """Every row a padding row (the state warm-up and capture run on)."""
        self._meta[: _layout_size(shape, self.max_blocks)].copy_(self._packed(shape, []))

    def _capture(self, shape: StepShape) -> _Captured:
        views = self._views(shape)
        self._pack_padding(shape)
        if not self.use_graphs:
            return _Captured(views, None, (), [])
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):  # these really run: their collectives stay in the ledger
                self._forward(shape, views)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        records: list[CollectiveRecord] = []
        graph = torch.cuda.CUDAGraph()
        real_ledger = self.collectives.ledger if self.collectives is not None else None
        if self.collectives is not None:
            self.collectives.ledger = CollectiveLedger()  # capture executes nothing: count it apart
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self._forward(shape, views)
            if self.collectives is not None:
                records = self.collectives.ledger.forward_records()
        finally:
            if self.collectives is not None and real_ledger is not None:
                self.collectives.ledger = real_ledger
        log.debug("captured %s (%d collectives)", shape, len(records))
        return _Captured(views, graph, outputs, records)

    # --- replay -----------------------------------------------------------------------------

    def _packed(self, shape: StepShape, seqs: Sequence[StepRows]) -> torch.Tensor:
        """The shape's int64 layout on the host: real sequences first, then padding."""
        q, m, tail = shape.tokens, self.max_blocks, shape.tail
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        index: list[int] = []
        dest: list[int] = []
        ctx: list[int] = []
        tables: list[int] = []
        masks: list[int] = []
        pad_mask = [1] * (q * tail)
        for i, s in enumerate(seqs):
            k = len(s.token_ids)
            first = s.context_len - k
            pad = q - k
            ids += [0] * pad + s.token_ids
            pos += [0] * pad + s.positions
            slots += [self.pad_slot] * pad + s.slots
            index += [first] * pad + list(range(first, s.context_len))
            dest += range(i * q + pad, i * q + q)
            ctx.append(s.context_len)
            tables += s.block_table + [0] * (m - len(s.block_table))
            if tail:
                masks += [1] * (pad * tail) + [int(x) for x in (s.tail_mask or ())]
        n_pad = shape.batch - len(seqs)
        ids += [0] * (q * n_pad)
        pos += [0] * (q * n_pad)
        slots += [self.pad_slot] * (q * n_pad)
        index += [0] * (q * n_pad)
        dest += [0] * (shape.rows - len(dest))
        ctx += [1] * n_pad
        tables += [0] * (m * n_pad)
        masks += pad_mask * n_pad
        return torch.tensor(ids + pos + slots + index + dest + ctx + tables + masks, dtype=torch.long)

    def run(self, shape: StepShape, seqs: Sequence[StepRows], hidden: torch.Tensor | None = None
            ) -> list[torch.Tensor]:
        """One step at ``shape`` (from ``shape_for``) -> each output's real rows, in ``seqs`` order:
        a per-row output [real rows, ...], a per-sequence one (``last_only`` logits) [len(seqs), ...].
        hidden: [real rows, shape.hidden] (the draft's hidden input) or None."""
        entry = self.captured[shape]
        v = entry.views
        self.runs += 1
        for s in seqs:
            if len(s.block_table) > self.max_blocks:
                raise ValueError(f"a block table of {len(s.block_table)} blocks exceeds the captured {self.max_blocks}")
        packed = self._packed(shape, seqs)
        self._meta[: packed.shape[0]].copy_(packed, non_blocking=True)
        num_real = sum(len(s.token_ids) for s in seqs)
        dest = v.dest[:num_real]
        if v.hidden is not None:
            if hidden is None:
                raise ValueError(f"{shape} takes a hidden input")
            v.hidden.index_copy_(0, dest, hidden.to(v.hidden.dtype))
        if entry.graph is None:
            outputs = self._forward(shape, v)
        else:
            entry.graph.replay()
            outputs = entry.outputs
            if self.collectives is not None:
                self.collectives.ledger.replay(entry.records)
        n = len(seqs)
        uniform = all(len(s.token_ids) == shape.tokens for s in seqs)
        out: list[torch.Tensor] = []
        for t in outputs:
            if t.shape[0] == shape.rows:
                out.append(t[:num_real] if uniform else t.index_select(0, dest))
            else:  # one row per sequence
                out.append(t[:n])
        return out
