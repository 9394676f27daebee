"""Decode forwards captured as CUDA graphs, one per padded batch size, replayed on static buffers.

At construction the runner allocates static inputs for the largest batch size (token ids,
positions, cache slots, block tables [B, max_blocks], context lengths), and for each batch size
(largest first, one shared memory pool) runs the model's decode forward twice eagerly on those
buffers (warm-up: Triton compiles, NCCL and cuBLAS set up) and captures a third run. ``run``
copies a decode step into the buffers, pads the batch to the next captured size, replays, and
returns the real rows' logits. Padding rows write their K/V to ``pad_slot`` (a slot the block
manager must never hand out; default: the cache's last slot) and attend to that one slot.

Collectives are captured with the forward (NCCL, FlashInfer's fused all-reduce). The ledger
is Python and does not run on replay: the records made while capturing are kept (in a
ledger of their own, so capture is not counted as execution) and added to the model's ledger
at every replay (``CollectiveLedger.replay``), so executed == planned still holds.

Needs a model whose kernels are ``graph_safe`` (layout read from device tensors only).
``use_graphs=False`` (the default off CUDA) runs the same padded, static-buffer forward eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
from ..models.parallel.comm_plan import ForwardPlan
from ..models.parallel.communicator import Communicator
from ..models.parallel.ledger import CollectiveLedger, CollectiveRecord

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
WARMUP_RUNS = 2


@dataclass
class CapturedDecode:
    batch_size: int
    graph: Any  # torch.cuda.CUDAGraph, or None when running eagerly
    logits: torch.Tensor | None  # the graph's output buffer [batch_size, vocab]
    records: list[CollectiveRecord]  # collectives of one forward, as captured
    plan: ForwardPlan  # the plan variant the captured forward ran


class CudaGraphRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, max_blocks_per_seq: int,
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, pad_slot: int | None = None,
                 use_graphs: bool | None = None) -> None:
        kernels = getattr(model, "kernels", None)
        if kernels is None or not kernels.graph_safe:
            raise ValueError("CUDA graphs need a model built with graph-safe kernels (Kernels.triton() or "
                             "Kernels.torch_native()); the reference attention reads Python lists")
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch sizes must be positive, got {batch_sizes}")
        self.model = model
        self.kv_cache = kv_cache
        self.comm: Communicator = model.comm  # type: ignore[assignment]
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_blocks = max_blocks_per_seq
        self.pad_slot = kv_cache.num_blocks * kv_cache.block_size - 1 if pad_slot is None else pad_slot
        device = next(iter(kv_cache.k.values())).device
        self.device = device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its KV cache on a CUDA device")
        b = self.batch_sizes[-1]
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), self.pad_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((b, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.context_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.captured: dict[int, CapturedDecode] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for bs in reversed(self.batch_sizes):
            self.captured[bs] = self._capture(bs)

    @property
    def ledger(self) -> CollectiveLedger:
        return self.comm.collectives.ledger

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size a step of ``num_seqs`` sequences runs at; None = too large."""
        return next((bs for bs in self.batch_sizes if bs >= num_seqs), None)

    def planned(self, num_seqs: int) -> list[tuple[str, str, str]]:
        """(site, op, group) of the collectives one replay runs for this many sequences."""
        bs = self.padded_size(num_seqs)
        if bs is None:
            raise ValueError(f"{num_seqs} sequences exceed the largest captured batch {self.batch_sizes[-1]}")
        return self.captured[bs].plan.expected()

    # --- capture ----------------------------------------------------------------------------

    def _forward(self, bs: int) -> torch.Tensor:
        """The decode forward of the first ``bs`` rows of the static buffers. Runs while capturing,
        so everything it computes (e.g. the metadata's token indices) is replayed too."""
        meta = PagedAttentionMetadata.decode(self.block_tables[:bs], self.context_lens[:bs])
        batch = ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            # The lists are not read by graph-safe kernels; they describe the padded shape only.
            query_lens=[1] * bs, context_lens=[1] * bs, slot_mapping=self.slot_mapping[:bs],
            block_tables=[[0]] * bs, kv_cache=self.kv_cache, paged=meta)
        logits: torch.Tensor = self.model(batch)
        return logits

    def _capture(self, bs: int) -> CapturedDecode:
        plan = self.comm.plan.select(bs)
        if not self.use_graphs:
            return CapturedDecode(bs, None, None, [], plan)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):  # these really run: their collectives stay in the ledger
                self._forward(bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        collectives = self.comm.collectives
        real_ledger = collectives.ledger
        collectives.ledger = CollectiveLedger()  # capture executes nothing: count it apart
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(bs)
            records = collectives.ledger.forward_records()
        finally:
            collectives.ledger = real_ledger
        log.debug("captured decode at batch %d (%d collectives)", bs, len(records))
        return CapturedDecode(bs, graph, logits, records, plan)

    # --- replay -----------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of n sequences (one new token each), all on the device.

        input_ids, positions, slot_mapping: [n]; block_tables: [n, <= max_blocks] int32;
        context_lens: [n] (cached tokens incl. the new one) -> logits [n, vocab]
        """
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        if bs is None:
            raise ValueError(f"{n} sequences exceed the largest captured batch {self.batch_sizes[-1]}")
        width = block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block tables of {width} blocks exceed the captured {self.max_blocks}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.block_tables[:n, :width].copy_(block_tables)
        self.context_lens[:n].copy_(context_lens)
        if n < bs:  # padding rows: a harmless one-token step on the pad slot
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(self.pad_slot)
            self.context_lens[n:bs].fill_(1)
        entry = self.captured[bs]
        if entry.graph is None:
            return self._forward(bs)[:n]
        entry.graph.replay()
        self.ledger.replay(entry.records)
        assert entry.logits is not None
        return entry.logits[:n]

    def run_batch(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode ``ForwardBatch`` (one new token per sequence) -> logits [n, vocab]."""
        if any(q != 1 for q in batch.query_lens) or batch.attn_masks is not None:
            raise ValueError("the CUDA-graph runner takes decode batches: one causal token per sequence")
        meta = batch.paged_metadata()
        return self.run(batch.input_ids, batch.positions, batch.slot_mapping, meta.block_tables,
                        meta.context_lens)
