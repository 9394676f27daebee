"""Attention over the paged KV cache: the plain torch reference.

Faster backends with the same signature (``AttentionBackend``): ``paged_attention_torch.py``
(CUDA-graph capturable torch ops) and ``decode_attention_triton.py`` (GPU decode kernel, which
hands steps of several new tokens per sequence to ``prefill_attention_triton.py``); a model
picks one at construction (``kernels.py``). Every backend takes GQA groups of any size (MLA's
absorbed attention: all of a rank's heads over one latent KV head) and K / V dims that differ; a
layer whose V is K's first columns (``KVCache.v_in_k``: MLA's latent cache) has K alone stored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..forward_batch import ForwardBatch

# (q [T, heads, d], k [T, kv_heads, d], v [T, kv_heads, dv], layer_id, batch, scale) -> [T, heads, dv]
AttentionBackend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, ForwardBatch, float], torch.Tensor]


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend each sequence to its whole context (fp32 math).
    A layer whose V is in K (``KVCache.v_in_k``, MLA's latent cache) stores K alone.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, v_head_dim]
    """
    cache = batch.kv_cache
    if cache is None:
        raise ValueError("attention needs a KV cache in the forward batch")
    kc, vc = cache.k[layer_id], cache.v[layer_id]
    kc[batch.slot_mapping] = k.to(kc.dtype)
    if layer_id not in cache.v_in_k:
        vc[batch.slot_mapping] = v.to(vc.dtype)
    bs = cache.block_size
    t, heads, dim = q.shape
    kv_heads = kc.shape[1]
    group = heads // kv_heads  # query head h reads KV head h // group
    out = torch.empty((t, heads, vc.shape[-1]), dtype=q.dtype, device=q.device)
    start = 0
    for i, (qlen, clen) in enumerate(zip(batch.query_lens, batch.context_lens)):
        if qlen == 0:
            continue
        table = torch.tensor(batch.block_tables[i], dtype=torch.long, device=q.device)
        pos = torch.arange(clen, device=q.device)
        slots = table[pos // bs] * bs + pos % bs
        keys = kc[slots].float()  # [clen, kv_heads, dim]
        values = vc[slots].float()
        qi = q[start : start + qlen].float().view(qlen, kv_heads, group, dim)
        scores = torch.einsum("qngd,knd->ngqk", qi, keys) * scale
        mask = None if batch.attn_masks is None else batch.attn_masks[i]
        if mask is None:
            qpos = torch.arange(clen - qlen, clen, device=q.device)
            mask = pos[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~mask[None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("ngqk,knd->qngd", probs, values)
        out[start : start + qlen] = o.reshape(qlen, heads, vc.shape[-1]).to(q.dtype)
        start += qlen
    return out
