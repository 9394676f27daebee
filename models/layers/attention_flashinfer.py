"""Paged attention through FlashInfer (GPU, bf16/fp16): planned once per forward, run by every layer.

Plain reference: ``attention.paged_attention_reference`` (and its capturable torch twin
``paged_attention_torch``); tests compare them on the GPU. The KV cache stays ours: each layer's
``[slots, kv_heads, dim]`` tensors are FlashInfer's NHD pages ``[num_blocks, block_size, kv_heads,
dim]`` as a view, and a block table is a page list.

``FlashInferPlanner`` (one per executor and KV cache) plans each forward from its
``AttentionLayout`` on the host — page indptr / indices / last-page lengths, the query rows, a
tree's custom mask — and returns the planned wrapper, which every layer's
``flashinfer_attention`` runs after writing its new K/V into the cache:

- one causal row per sequence (decode): the project's Triton split-KV decode kernel, at every batch (no
  plan at all: it reads the batch's device metadata, so a decode shape can be chained). Measured under
  CUDA graphs on an H200 (GQA 32/8, head dim 128, bench/results/2026-12-02-decode-launch-sweep-h200.json),
  against FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores, the faster of its two:
  batch 64 at context 160 15.8 vs 28.7 us per layer, batch 32 11.7 vs 16.3; at long contexts FlashInfer's
  is faster (batch 64, 1024 / 4096 tokens: 90 / 344 vs 81 / 260 us; batch 32: 50 / 175 vs 46 / 136) —
  a captured batch would need a graph per kernel to switch with the context, which it does not have;
- anything else (prefill chunks, mixed batches, a chain verify, draft steps): the paged prefill
  wrapper, causal; a tree verify (or tree draft step): the same with its custom mask.

Under CUDA graphs each captured shape gets its own wrapper with static buffers sized for the
graph's padded batch (``graph_state``); ``plan_graph`` refills them before the capture and before
every replay, so the work follows the real context lengths, never the captured maximum. The FA2
backend is pinned (the prebuilt modules of ``shared/gpu`` are FA2; README says how to rebuild).

Planning a captured shape never waits for the GPU (a wait leaves it idle while the host prepares the next
launch; a speculative step plans several forwards: before this,
bench/results/2026-12-02-spec-decode-profile-syncs-smollm2-h200.json found 38 waits per SmolLM2 tree step,
30 of them in FlashInfer's plan). The page list goes to the device asynchronously before ``plan`` (FlashInfer
copies a host page list synchronously), and a captured tree shape's mask is packed here on the host
(``pack_tree_masks``; FlashInfer's packing reads its output size back from the device) and its byte offsets
written into the shape's own offset buffer after ``plan`` (which, handed a packed mask, fills that buffer
with bit offsets, right only for one sequence: ``MaskedGraphPrefill``). An eager forward with a tree mask
(no captured shape fits) still lets FlashInfer pack it, and waits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..forward_batch import ForwardBatch, KVCache
from .attention_layout import SUPPORTED_HEAD_DIMS, AttentionLayout, GraphSlot, flashinfer_supports
from .decode_attention_triton import paged_decode_attention_triton
from .kv_write_triton import write_kv_triton

WORKSPACE_BYTES = 256 << 20


class TritonDecodePlan:
    """The plan of a decode batch: the Triton kernel reads the batch's paged metadata itself."""


def flashinfer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
                         scale: float) -> torch.Tensor:
    """Store the new K/V, then attend with the forward's plan (``batch.attention``); the scale was
    planned. q: [T, heads, dim]; k, v: [T, kv_heads, dim] -> [T, heads, dim]"""
    cache, planned = batch.kv_cache, batch.attention
    if cache is None:
        raise ValueError("attention needs a KV cache in the forward batch")
    kc, vc = cache.k[layer_id], cache.v[layer_id]
    if q.shape[0] == 0:  # an idle DP group's empty forward
        return q.new_empty((0, q.shape[1], vc.shape[-1]))
    if planned is None:
        raise ValueError("FlashInfer attention needs the forward's plan (ForwardBatch.attention)")
    if isinstance(planned, TritonDecodePlan):
        return paged_decode_attention_triton(q, k, v, layer_id, batch, scale)
    write_kv_triton(kc, vc, batch.slot_mapping, k, v)
    bs = cache.block_size
    pages = (kc.view(-1, bs, kc.shape[1], kc.shape[2]), vc.view(-1, bs, vc.shape[1], vc.shape[2]))
    out: torch.Tensor = planned.run(q.contiguous(), pages)
    return out


class MaskedGraphPrefill:
    """A captured tree shape's prefill wrapper and the per-sequence mask offsets (bytes, our buffer)
    its kernel reads at run time."""

    def __init__(self, wrapper: Any, mask_indptr: torch.Tensor) -> None:
        self.wrapper = wrapper
        self.mask_indptr = mask_indptr

    def run(self, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.wrapper.run(q, pages)
        return out


def kernel_kv_lens(layout: AttentionLayout) -> list[int]:
    """The context length FlashInfer's kernel sees per sequence (``FlashInferPlanner._pages``' last
    page lengths): the real one, or 1 for an empty sequence."""
    return [kv if kv > 0 else 1 for kv in layout.kv_lens]


def full_masks(layout: AttentionLayout) -> list[np.ndarray]:
    """Every sequence's [qo_len, kv_len] mask at the context length the kernel sees: causal, or its tail
    mask over the last slots (every slot before them visible)."""
    out = []
    tails = layout.tail_masks or (None,) * len(layout.qo_lens)
    for q, kv, tail in zip(layout.qo_lens, kernel_kv_lens(layout), tails):
        m = np.ones((q, kv), dtype=bool)
        if tail is None:
            m = np.tril(m, kv - q)
        else:
            width = len(tail) // q
            m[:, kv - width:] = np.asarray(tail, dtype=bool).reshape(q, width)
        out.append(m)
    return out


def pack_tree_masks(layout: AttentionLayout) -> tuple[np.ndarray, list[int]]:
    """``full_masks`` bit-packed little-endian the way FlashInfer's kernel reads them, each sequence from a
    byte boundary. -> (packed bytes, byte offset of each sequence and the end)"""
    parts = [np.packbits(m.ravel(), bitorder="little") for m in full_masks(layout)]
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + int(part.size))
    return (np.concatenate(parts) if parts else np.zeros(1, dtype=np.uint8)), offsets


class FlashInferPlanner:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float, kv_cache: KVCache) -> None:
        import flashinfer

        self._fi = flashinfer
        first = next(iter(kv_cache.k.values()))
        self.device = first.device
        self.dtype = first.dtype
        if not flashinfer_supports(head_dim, self.dtype):
            raise ValueError(f"FlashInfer attention here takes head dims {SUPPORTED_HEAD_DIMS} in bf16/fp16, "
                             f"not {head_dim} in {self.dtype}")
        self.heads, self.kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.scale = scale
        self.block_size = kv_cache.block_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    # --- host-side layout -------------------------------------------------------------------------

    def _pages(self, layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.block_size
        indptr, indices, last = [0], [], []
        for kv, table in zip(layout.kv_lens, layout.block_tables):
            n = max(-(-kv // bs), 1)
            pages = list(table[:n])
            pages += [0] * (n - len(pages))  # padding sequences (a graph's) read block 0
            indices += pages
            indptr.append(indptr[-1] + n)
            last.append(kv - (n - 1) * bs if kv > 0 else 1)
        i32 = torch.int32
        return torch.tensor(indptr, dtype=i32), torch.tensor(indices or [0], dtype=i32), torch.tensor(last, dtype=i32)

    @staticmethod
    def _qo_indptr(layout: AttentionLayout) -> torch.Tensor:
        out = [0]
        for q in layout.qo_lens:
            out.append(out[-1] + q)
        return torch.tensor(out, dtype=torch.int32)

    def _mask(self, layout: AttentionLayout) -> torch.Tensor | None:
        """Every sequence's mask, flattened and concatenated (FlashInfer packs it), or None: all causal."""
        if not layout.has_masks:
            return None
        return torch.from_numpy(np.concatenate([m.ravel() for m in full_masks(layout)])).to(self.device,
                                                                                          non_blocking=True)

    def _plan_prefill(self, wrapper: Any, layout: AttentionLayout) -> None:
        indptr, indices, last = self._pages(layout)
        pages = indices.to(self.device, non_blocking=True)
        common = dict(pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        dims = (self.heads, self.kv_heads, self.head_dim, self.block_size)
        if isinstance(wrapper, MaskedGraphPrefill):
            packed, offsets = pack_tree_masks(layout)
            wrapper.wrapper.plan(self._qo_indptr(layout), indptr, pages, last, *dims, causal=False,
                                 packed_custom_mask=torch.from_numpy(packed).to(self.device, non_blocking=True),
                                 **common)
            wrapper.mask_indptr.copy_(torch.tensor(offsets, dtype=torch.int32), non_blocking=True)
            return
        mask = self._mask(layout)
        wrapper.plan(self._qo_indptr(layout), indptr, pages, last, *dims, custom_mask=mask, causal=mask is None,
                     **common)

    # --- AttentionPlanner -------------------------------------------------------------------------

    def plan(self, layout: AttentionLayout) -> Any:
        if layout.is_decode:
            return TritonDecodePlan()
        self._plan_prefill(self._prefill, layout)
        return self._prefill

    def graph_state(self, slot: GraphSlot) -> Any:
        fi, dev, i32 = self._fi, self.device, torch.int32
        b = slot.batch
        if self.device_only(slot):
            return TritonDecodePlan()
        indptr = torch.zeros(b + 1, dtype=i32, device=dev)
        indices = torch.zeros(b * max(slot.max_blocks, 1), dtype=i32, device=dev)
        last = torch.ones(b, dtype=i32, device=dev)
        qo = torch.arange(b + 1, dtype=i32, device=dev) * slot.tokens
        extra: dict[str, torch.Tensor] = {}
        if slot.tail:
            mask_bits = b * slot.tokens * max(slot.max_blocks, 1) * self.block_size
            extra = {"custom_mask_buf": torch.zeros(-(-mask_bits // 8) + b, dtype=torch.uint8, device=dev),
                     "mask_indptr_buf": torch.zeros(b + 1, dtype=i32, device=dev)}
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo, paged_kv_indptr_buf=indptr,
            paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last, backend="fa2", **extra)
        return MaskedGraphPrefill(wrapper, extra["mask_indptr_buf"]) if slot.tail else wrapper

    def device_only(self, slot: GraphSlot) -> bool:
        return slot.tokens == 1 and slot.tail == 0

    def plan_graph(self, state: Any, layout: AttentionLayout) -> None:
        if not isinstance(state, TritonDecodePlan):
            self._plan_prefill(state, layout)


def flashinfer_planner(num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                       kv_cache: KVCache) -> FlashInferPlanner:
    return FlashInferPlanner(num_qo_heads, num_kv_heads, head_dim, scale, kv_cache)
