"""Kernel choices of the GPU's fast set, measured under CUDA graphs on the Llama-3-8B shape.

    . bench/device_env.sh && python -P bench/attention_kernels.py --out $OUT/attention-kernels.json

Decode attention (GQA 32/8, head_dim 128, bf16) at batch 1/16/64 and contexts 160/1024 over
scattered pages: FlashInfer's decode wrapper with tensor cores, without, and the project's Triton
decode kernel; the new-K/V store (two ``index_copy_`` vs one Triton launch); RMSNorm, SiLU-and-mul
and RoPE: the project's Triton kernels against FlashInfer's. Each op is captured 32 times in one graph
(one per layer of a step) and the graph replayed; µs per call = median replay / 32.

The decode kernel's cuts are swept by ``bench/decode_rows_probe.py``, over 32 layers' caches as a step reads
them (the ``--sweep`` that was here replayed one layer's cache, warm in L2 at short contexts: its record,
2026-12-02-decode-launch-sweep-h200.json, is kept for its FlashInfer column).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, cuda_graph, record_header, timed, write_record

progress = Progress("attention_kernels")
CALLS = 32
BLOCK = 16


def graph_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """µs per call of fn, captured CALLS times in one CUDA graph and replayed."""
    g = cuda_graph(fn, CALLS)
    g.replay()
    times = [timed(g.replay, 1, torch.device("cuda")) for _ in range(reps)]
    return 1e6 * statistics.median(times) / CALLS


def flashinfer_decode(kv: Any, tables: list[tuple[int, ...]], ctx: int, slots: torch.Tensor, tensor_cores: bool
                      ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """FlashInfer's paged decode wrapper as a captured batch would hold it (static buffers, planned once for
    these contexts; the engine's decode runs the Triton kernel, this is the comparison), with the new K/V
    stored first as the engine's layer does. -> fn(q, k, v)"""
    import flashinfer

    from fusedserve.models.layers.kv_write_triton import write_kv_triton

    dev, i32, b = torch.device("cuda"), torch.int32, len(tables)
    pages = -(-ctx // BLOCK)
    indptr = torch.arange(b + 1, dtype=i32) * pages
    indices = torch.tensor([p for t in tables for p in t[:pages]], dtype=i32)
    last = torch.full((b,), ctx - (pages - 1) * BLOCK, dtype=i32)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, backend="fa2",
        paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=i32, device=dev),
        paged_kv_indices_buffer=torch.zeros(b * pages, dtype=i32, device=dev),
        paged_kv_last_page_len_buffer=torch.ones(b, dtype=i32, device=dev))
    wrapper.plan(indptr, indices.to(dev), last, 32, 8, 128, BLOCK, pos_encoding_mode="NONE",
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=128 ** -0.5)
    kc, vc = kv.k[0], kv.v[0]
    paged = (kc.view(-1, BLOCK, 8, 128), vc.view(-1, BLOCK, 8, 128))

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv_triton(kc, vc, slots, k, v)
        out: torch.Tensor = wrapper.run(q, paged)
        return out

    return run


@dataclass
class DecodeCase:
    """A decode step's inputs at the 8B shape (GQA 32/8, head dim 128, bf16): ``batch`` sequences of
    ``ctx`` tokens over scattered pages."""

    kv: Any
    pages: torch.Tensor  # [batch, pages of ctx] int32
    tables: list[tuple[int, ...]]
    slots: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def decode_case(batch: int, ctx: int, layers: int = 1) -> DecodeCase:
    """(``layers``: caches of that many layers, each random, on the same pages.)"""
    from fusedserve.models.forward_batch import KVCache

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(batch * 7 + ctx)
    pages = -(-ctx // BLOCK)
    nb = batch * pages + 1
    kv = KVCache.allocate({i: (8, 128) for i in range(layers)}, nb, BLOCK, bf, dev)
    for i in range(layers):
        kv.k[i].normal_(generator=g)
        kv.v[i].normal_(generator=g)
    perm = torch.randperm(nb - 1, device=dev, generator=g).view(batch, pages).to(torch.int32)
    tables = [tuple(r) for r in perm.tolist()]
    slots = torch.tensor([t[(ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK for t in tables], device=dev)
    return DecodeCase(kv, perm, tables, slots, torch.randn(batch, 32, 128, device=dev, dtype=bf, generator=g),
                      torch.randn(batch, 8, 128, device=dev, dtype=bf, generator=g),
                      torch.randn(batch, 8, 128, device=dev, dtype=bf, generator=g))


def attention(batch: int, ctx: int) -> dict[str, float]:
    from fusedserve.models.forward_batch import ForwardBatch, PagedAttentionMetadata
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton

    dev = torch.device("cuda")
    c = decode_case(batch, ctx)
    meta = PagedAttentionMetadata.decode(c.pages.contiguous(), torch.full((batch,), ctx, dtype=torch.int32,
                                                                          device=dev))
    out: dict[str, float] = {}
    for name, tc in (("flashinfer_tensor_cores", True), ("flashinfer_cuda_cores", False)):
        out[name] = graph_us(partial(flashinfer_decode(c.kv, c.tables, ctx, c.slots, tc), c.q, c.k, c.v))
    fb = ForwardBatch(torch.zeros(batch, dtype=torch.long, device=dev), torch.zeros(batch, device=dev), [1] * batch,
                      [ctx] * batch, c.slots, [list(t) for t in c.tables], c.kv, paged=meta)
    out["triton_decode"] = graph_us(partial(paged_decode_attention_triton, c.q, c.k, c.v, 0, fb, 128 ** -0.5))
    return out


def small_ops(rows: int) -> dict[str, float]:
    import flashinfer

    from fusedserve.models.layers.kv_write_triton import write_kv_triton
    from fusedserve.models.layers.paged_attention_torch import write_kv
    from fusedserve.models.layers.rms_norm_triton import add_rms_norm_triton, rms_norm_triton
    from fusedserve.models.layers.rope_triton import rope_triton
    from fusedserve.models.layers.rotary import rope_inv_freq
    from fusedserve.models.layers.silu_mul_triton import silu_and_mul_triton

    dev, bf = torch.device("cuda"), torch.bfloat16
    x, r = torch.randn(rows, 4096, device=dev, dtype=bf), torch.randn(rows, 4096, device=dev, dtype=bf)
    w = torch.rand(4096, device=dev, dtype=bf) + 0.5
    gu = torch.randn(rows, 2 * 14336, device=dev, dtype=bf)
    kc, vc = (torch.zeros(4096, 8, 128, device=dev, dtype=bf) for _ in range(2))
    k, v = torch.randn(rows, 8, 128, device=dev, dtype=bf), torch.randn(rows, 8, 128, device=dev, dtype=bf)
    slots = torch.randperm(4096, device=dev)[:rows]
    qk = torch.randn(rows, 40, 128, device=dev, dtype=bf)
    q, kk = qk[:, :32], qk[:, 32:]
    pos = torch.randint(0, 4000, (rows,), device=dev)
    inv = rope_inv_freq(128, 500000.0, None).to(dev)
    return {
        "write_kv_index_copy": graph_us(lambda: write_kv(kc, vc, slots, k, v)),
        "write_kv_triton": graph_us(lambda: write_kv_triton(kc, vc, slots, k, v)),
        "rms_norm_triton": graph_us(lambda: rms_norm_triton(x, w, 1e-5)),
        "rms_norm_flashinfer": graph_us(lambda: flashinfer.norm.rmsnorm(x, w, 1e-5)),
        "add_rms_norm_triton": graph_us(lambda: add_rms_norm_triton(x, r, w, 1e-5)),
        "silu_and_mul_triton": graph_us(lambda: silu_and_mul_triton(gu)),
        "silu_and_mul_flashinfer": graph_us(lambda: flashinfer.activation.silu_and_mul(gu)),
        "rope_triton": graph_us(lambda: rope_triton(pos, q, kk, inv)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    record: dict[str, Any] = {**record_header(), "calls_per_graph": CALLS, "attention": [], "small_ops": []}
    for batch in (1, 16, 64):
        for ctx in (160, 1024):
            row = {"batch": batch, "context": ctx, **attention(batch, ctx)}
            record["attention"].append(row)
            progress(str(row))
    for rows in (1, 16, 64):
        row = {"rows": rows, **small_ops(rows)}
        record["small_ops"].append(row)
        progress(str(row))
    write_record(record, args.out or f"bench/results/{record['date']}-attention-kernels-h200.json")


if __name__ == "__main__":
    main()
