"""Store a forward's new K and V rows at their cache slots in one Triton launch (GPU).

Plain reference: ``paged_attention_torch.write_kv`` (an ``index_copy_`` per tensor); one program per
new row copies that row's K and V (K alone where V is in K: MLA's latent cache). CUDA-graph safe
(slots are read on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, stride_kc, stride_vc,
                     K_WIDTH: tl.constexpr, V_WIDTH: tl.constexpr, K_PAD: tl.constexpr, V_PAD: tl.constexpr,
                     HAS_V: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    ko = tl.arange(0, K_PAD)
    km = ko < K_WIDTH
    tl.store(kc_ptr + slot * stride_kc + ko, tl.load(k_ptr + row * stride_k + ko, mask=km), mask=km)
    if HAS_V:
        vo = tl.arange(0, V_PAD)
        vm = vo < V_WIDTH
        tl.store(vc_ptr + slot * stride_vc + vo, tl.load(v_ptr + row * stride_v + vo, mask=vm), mask=vm)


def write_kv_triton(kc: torch.Tensor, vc: torch.Tensor | None, slot_mapping: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """kc, vc: [slots, kv_heads, dim] (contiguous rows; ``vc`` None: V is in K, K alone is stored);
    k, v: [T, kv_heads, dim]; slot_mapping: [T]."""
    t = k.shape[0]
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()  # read at unit stride (a no-op for the engine's buffers)
    k2 = k.reshape(t, -1).to(kc.dtype)
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    kw = k2.shape[1]
    if vc is None:
        v2, vcache, vw = k2, kc, 1  # not read (HAS_V off)
    else:
        v2 = v.reshape(t, -1).to(vc.dtype)
        if v2.stride(-1) != 1:
            v2 = v2.contiguous()
        vcache, vw = vc, v2.shape[1]
    _write_kv_kernel[(t,)](k2, v2, kc, vcache, slot_mapping, k2.stride(0), v2.stride(0), kc.stride(0),
                           vcache.stride(0), K_WIDTH=kw, V_WIDTH=vw, K_PAD=triton.next_power_of_2(kw),
                           V_PAD=triton.next_power_of_2(vw), HAS_V=vc is not None, **pdl_launch())
