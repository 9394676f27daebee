"""Paged attention on the GPU's fast set (bf16/fp16): FlashInfer for eager forwards, the project's
Triton kernels for decode batches and every captured shape.

Plain reference: ``attention.paged_attention_reference`` (and its capturable torch twin
``paged_attention_torch``); tests compare them on the GPU. The KV cache stays ours: each layer's
``[slots, kv_heads, dim]`` tensors are FlashInfer's NHD pages ``[num_blocks, block_size, kv_heads,
dim]`` as a view, and a block table is a page list.

``FlashInferPlanner`` (one per executor and KV cache) plans each forward from its ``AttentionLayout``
and returns the plan every layer's ``flashinfer_attention`` runs:

- a decode batch (one causal row per sequence), eager or captured: ``DevicePlan`` — the Triton split-KV
  decode kernel, which reads the batch's device metadata itself (nothing planned on the host). Measured
  under CUDA graphs on an H200 (GQA 32/8, head dim 128, bench/results/2026-12-02-decode-launch-sweep-h200.json)
  against FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores, the faster of its two:
  batch 64 at context 160 15.8 vs 28.7 us per layer, batch 32 11.7 vs 16.3; at long contexts FlashInfer's
  is faster (batch 64, 1024 / 4096 tokens: 90 / 344 vs 81 / 260 us; batch 32: 50 / 175 vs 46 / 136) —
  a captured batch would need a graph per kernel to switch with the context, which it does not have;
- every other captured shape (a chain verify, a tree verify, a draft step or first pass: speculation's
  shapes, a few rows per sequence): ``DevicePlan`` too — the Triton paged prefill kernel, a tree's mask
  read from the metadata's ``tail_mask``. FlashInfer's plan would run on the host before each replay
  (0.26 / 0.42 ms a call under the profiler in a SmolLM2 chain-3 / tree generate: 2 per chain step, 8 per
  tree step, the GPU idle meanwhile: bench/results/2026-12-02-spec-decode-profile-planning-fixes-smollm2-h200.json),
  and a device-only plan is what lets shapes be chained;
- eager forwards of several rows (prefill chunks, mixed batches, a tree no captured shape fits): FlashInfer's
  paged prefill wrapper planned on the host, causal or with the tree's custom mask (FlashInfer packs it,
  which waits for the device). The page list goes to the device before ``plan`` (a host list is copied
  synchronously). The FA2 backend is pinned (the prebuilt modules of ``shared/gpu`` are FA2; README says
  how to rebuild).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..forward_batch import ForwardBatch, KVCache
from .attention_layout import SUPPORTED_HEAD_DIMS, AttentionLayout, flashinfer_supports
from .decode_attention_triton import paged_decode_attention_triton
from .kv_write_triton import write_kv_triton

WORKSPACE_BYTES = 256 << 20


class DevicePlan:
    """The plan of a decode batch or a captured shape: the Triton kernels read the batch's device metadata
    (``ForwardBatch.paged_metadata()``, a tree's ``tail_mask`` included) themselves."""


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
    if isinstance(planned, DevicePlan):
        return paged_decode_attention_triton(q, k, v, layer_id, batch, scale)
    write_kv_triton(kc, vc, batch.slot_mapping, k, v)
    bs = cache.block_size
    pages = (kc.view(-1, bs, kc.shape[1], kc.shape[2]), vc.view(-1, bs, vc.shape[1], vc.shape[2]))
    out: torch.Tensor = planned.run(q.contiguous(), pages)
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


class FlashInferPlanner:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float, kv_cache: KVCache) -> None:
        import flashinfer

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
        mask = self._mask(layout)
        wrapper.plan(self._qo_indptr(layout), indptr, pages, last, *dims, custom_mask=mask, causal=mask is None,
                     **common)

    # --- AttentionPlanner -------------------------------------------------------------------------

    def plan(self, layout: AttentionLayout) -> Any:
        if layout.is_decode:
            return DevicePlan()
        self._plan_prefill(self._prefill, layout)
        return self._prefill

    def graph_plan(self) -> Any:
        return DevicePlan()


def flashinfer_planner(num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                       kv_cache: KVCache) -> FlashInferPlanner:
    return FlashInferPlanner(num_qo_heads, num_kv_heads, head_dim, scale, kv_cache)
