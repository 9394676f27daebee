"""Paged attention in plain torch ops that CUDA graphs can capture (GQA, MLA's latent cache; decode,
verify, short prefill).

Same function as ``attention.paged_attention_reference`` (its plain reference, compared in
tests/test_paged_attention_torch.py), but every piece of the layout comes from
``ForwardBatch.paged_metadata()`` as device tensors of static shape: no Python loop over
sequences, no ``.item()``, no host sync. Each new token attends to the cache indices
``0..token_index`` of its sequence, gathered through the block table; keys past that (block
table padding, future tokens) are masked. Tree masks given as ``batch.attn_masks`` (eager
speculative verify) go to the reference; a tree given as the metadata's ``tail_mask`` (device
tensor) stays here, capturable. Memory grows as tokens x max_blocks*block_size, so on the GPU
this is no fast path: the ``triton`` kernel set attends with ``decode_attention_triton.py``
(decode) and ``prefill_attention_triton.py`` (several new tokens per sequence), and sends only
trees here.
"""

from __future__ import annotations

import torch

from ..forward_batch import ForwardBatch, PagedAttentionMetadata
from .attention import paged_attention_reference


def write_kv(kc: torch.Tensor, vc: torch.Tensor | None, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store the new K/V at their slots; ``vc`` None: V is in K (``KVCache.v_in_k``), K alone is stored.
    kc, vc: [slots, kv_heads, dim]; k, v: [T, kv_heads, dim]"""
    kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
    if vc is not None:
        vc.index_copy_(0, slot_mapping, v.to(vc.dtype))


def attend_paged(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: PagedAttentionMetadata,
                 block_size: int, scale: float, v_in_k: bool = False) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (fp32 math). ``v_in_k``: ``vc``
    is K's first columns, read out of the gathered keys.

    q: [T, heads, head_dim]; kc, vc: [slots, kv_heads, dim] -> [T, heads, v_dim] in q's dtype
    """
    t, heads, dim = q.shape
    kv_heads = kc.shape[1]
    group = heads // kv_heads
    max_blocks = meta.block_tables.shape[1]
    idx = torch.arange(max_blocks * block_size, device=q.device)  # cache index within a sequence
    tables = meta.block_tables.long()
    slots = tables[:, idx // block_size] * block_size + idx % block_size  # [B, C]
    token_slots = slots.index_select(0, meta.token_seq)  # [T, C]
    keys = kc[token_slots].float()  # [T, C, kv_heads, dim]
    values = keys[..., : vc.shape[-1]] if v_in_k else vc[token_slots].float()
    qg = q.view(t, kv_heads, group, dim).float()
    scores = torch.einsum("tngd,tcnd->tngc", qg, keys) * scale
    visible = idx[None, :] <= meta.token_index[:, None]  # [T, C]
    if meta.tail_mask is not None:  # a tree: its own mask over the context's last L indices
        tail = meta.tail_mask.shape[1]
        rel = idx[None, :] - (meta.context_lens.long().index_select(0, meta.token_seq) - tail)[:, None]
        in_tail = (rel >= 0) & (rel < tail)
        visible = torch.where(in_tail, meta.tail_mask.gather(1, rel.clamp(0, tail - 1)), rel < 0)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("tngc,tcnd->tngd", probs, values)
    return out.reshape(t, heads, vc.shape[-1]).to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend (causal). Signature of the reference.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, v_head_dim]
    """
    cache = batch.kv_cache
    if cache is None:
        raise ValueError("attention needs a KV cache in the forward batch")
    if batch.attn_masks is not None and any(m is not None for m in batch.attn_masks):
        return paged_attention_reference(q, k, v, layer_id, batch, scale)  # a draft tree (eager only)
    kc, vc = cache.k[layer_id], cache.v[layer_id]
    shared = layer_id in cache.v_in_k
    write_kv(kc, None if shared else vc, batch.slot_mapping, k, v)
    return attend_paged(q, kc, vc, batch.paged_metadata(), cache.block_size, scale, shared)
