"""The Triton kernels equal their plain references, run on CPU by Triton's interpreter.

Skipped where Triton is not installed (CI's CPU venv); on a GPU the real kernels are checked by
tests/test_gpu_decode.py. The outer test re-runs this file in a subprocess with TRITON_INTERPRET=1
(read when the kernels are defined); the inner tests run only there.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch

pytest.importorskip("triton")

if TYPE_CHECKING:
    from fusedserve.models.forward_batch import ForwardBatch, KVCache

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inner = pytest.mark.skipif(not INTERPRETING, reason="runs inside the TRITON_INTERPRET=1 subprocess")

if INTERPRETING:  # Triton's interpreter turns a loaded scalar into int() of a 1-element array (numpy 2 refuses)
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor

    # Two of the interpreter's float conversions are not the GPU's, so kernels are checked with torch's
    # (round to nearest even, as the hardware's cvt.rn): fp32 -> e4m3 rounds half up and loses the carry
    # when the mantissa rounds over (31.76 -> 16, not 32), and fp32 -> bf16 truncates.
    _fp_to_fp, _cast = _interpreter.InterpreterBuilder.create_fp_to_fp, _interpreter.InterpreterBuilder.cast_impl

    def _torch_cast(src, dst_type, dtype, view):  # type: ignore[no-untyped-def]
        out = torch.from_numpy(np.ascontiguousarray(src.data)).to(dtype).view(view).numpy()
        return _interpreter.TensorHandle(out.view(np.uint8 if view == torch.uint8 else np.uint16), dst_type.scalar)

    def _create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            return _torch_cast(src, dst_type, torch.float8_e4m3fn, torch.uint8)
        return _fp_to_fp(self, src, dst_type, rounding_mode)

    def _cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            return _torch_cast(src, dst_type, torch.bfloat16, torch.int16)
        return _cast(self, src, dst_type)

    _interpreter.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp
    _interpreter.InterpreterBuilder.cast_impl = _cast_impl


@pytest.mark.skipif(INTERPRETING or torch.cuda.is_available(), reason="outer runner; GPUs run the real kernels")
def test_kernels_under_the_triton_interpreter() -> None:
    # The interpreted kernels take ~2.5-3 min on 2 idle cores and ~4 min on a busy CI machine (2026-12-04: 249 s
    # against the earlier 300 s bound): the bound leaves twice the idle time, under pytest's 600 s per test.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interp"],
                          check=False, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.2e}"


@inner
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_rms_norm(dtype: torch.dtype) -> None:
    from fusedserve.models.layers.rms_norm_triton import add_rms_norm_triton, rms_norm_triton
    from fusedserve.models.parallel.fusion.reference import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 96, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    _close(rms_norm_triton(x, w, 1e-5), rms_norm(x, w, 1e-5), tol)
    (n1, s1), (n2, s2) = add_rms_norm_triton(x, r, w, 1e-5), add_rms_norm(x, r, w, 1e-5)
    _close(s1, s2, tol)  # (the interpreter may round to bf16 differently from the GPU)
    _close(n1, n2, tol)


@inner
def test_interp_rope_on_strided_views() -> None:
    from fusedserve.models.layers.rope_triton import rope_triton
    from fusedserve.models.layers.rotary import rope_inv_freq, rope_reference

    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g).to(torch.bfloat16)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    pos = torch.tensor([[0, 3, 17, 200, 4095], [1] * 5]).t().contiguous()[:, 0]  # the positions a strided view too
    inv = rope_inv_freq(16, 500000.0, None)
    (q1, k1), (q2, k2) = rope_triton(pos, q, k, inv), rope_reference(pos, q, k, inv)
    _close(q1, q2, 1e-2)
    _close(k1, k2, 1e-2)


@inner
def test_interp_silu_and_mul() -> None:
    from fusedserve.models.layers.mlp import silu_and_mul
    from fusedserve.models.layers.silu_mul_triton import silu_and_mul_triton

    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    _close(silu_and_mul_triton(x), silu_and_mul(x), 1e-2)


@inner
def test_interp_decode_gemv_equals_f_linear() -> None:
    """The fast set's one-row matmul (``decode_linear``: the GEMV at every tile ``gemv_tile`` picks, with a
    bias, a masked last tile where none divides the width) equals F.linear; an output count the kernels do
    not take goes to F.linear itself; ``gemv_triton`` (the GEMV at a given tile) too, and F.linear at 2-8 rows."""
    import torch.nn.functional as F

    from fusedserve.models.layers.linear_triton import decode_linear, gemv_tile, gemv_triton

    assert gemv_tile(4096) == (4, 2048, 8) and gemv_tile(14336) == (4, 2048, 8) and gemv_tile(3072) == (4, 1024, 4)
    assert gemv_tile(576) == (4, 1024, 4) and gemv_tile(100) == (4, 128, 4)
    assert gemv_tile(1536) == (4, 2048, 8) and gemv_tile(1152) == (4, 2048, 8) and gemv_tile(1024) == (4, 1024, 4)
    g = torch.Generator().manual_seed(6)
    for k in (2048, 1024, 768, 576, 1300):
        w = torch.randn(12, k, generator=g).to(torch.bfloat16)
        b = torch.randn(12, generator=g).to(torch.bfloat16)
        x = torch.randn(1, k, generator=g).to(torch.bfloat16)
        _close(decode_linear(x, w), F.linear(x, w), 1e-2)
        _close(decode_linear(x, w, b), F.linear(x, w, b), 1e-2)
        _close(gemv_triton(x, w, b, 4, 256), F.linear(x, w, b), 1e-2)
        _close(gemv_triton(x, w, None, 2, 64, 2), F.linear(x, w), 1e-2)
        _close(gemv_triton(x, w, None, *gemv_tile(k)), F.linear(x, w), 1e-2)  # one masked tile at 576
        for m in (2, 8):
            xm = torch.randn(m, k, generator=g).to(torch.bfloat16)
            assert torch.equal(gemv_triton(xm, w, b), F.linear(xm, w, b))
            assert torch.equal(decode_linear(xm, w), F.linear(xm, w))
    w = torch.randn(10, 576, generator=g).to(torch.bfloat16)  # 10 outputs: no multiple of 4
    x = torch.randn(1, 576, generator=g).to(torch.bfloat16)
    assert torch.equal(decode_linear(x, w), F.linear(x, w))


@inner
def test_interp_decode_gemm_equals_f_linear() -> None:
    """The fast set's matmul at 2..64 rows (``decode_linear`` -> ``gemm_triton``: tensor cores, operands
    swapped, rows masked up to the padded block, a bias, K in 64- or 128-wide steps (or wider, the last masked), K split in two where
    the output tiles are few) equals F.linear; more rows, fp32, or a shape no tile takes go to F.linear
    itself."""
    import torch.nn.functional as F

    from fusedserve.models.layers.linear_triton import decode_gemm_tile, decode_linear, gemm_triton

    assert decode_gemm_tile(16, 6144, 4096) == (64, 128, 6, 4)
    assert decode_gemm_tile(64, 28672, 4096) == (128, 128, 4, 4) and decode_gemm_tile(16, 28672, 4096) == (64, 128, 6, 4)
    # a small model's longer widths: one K tile of 16 outputs (K masked to a power of two), up to 16 rows
    assert decode_gemm_tile(8, 960, 576) == (64, 64, 6, 4) and decode_gemm_tile(16, 576, 1536) == (16, 2048, 1, 4)
    assert decode_gemm_tile(8, 576, 1728) == (16, 2048, 1, 4) and decode_gemm_tile(17, 576, 1536) == (64, 128, 6, 4)
    assert decode_gemm_tile(8, 8, 1536) is None
    assert decode_gemm_tile(65, 4096, 4096) is None and decode_gemm_tile(8, 4100, 4096) is None
    assert decode_gemm_tile(8, 4096, 4000) is None
    g = torch.Generator().manual_seed(7)
    for m, n, k in ((2, 64, 256), (5, 128, 576), (16, 64, 128), (33, 128, 256), (3, 32, 1536), (4, 64, 1100),
                    (4, 64, 4096)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        b = torch.randn(n, generator=g).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        _close(decode_linear(x, w), F.linear(x, w), 1e-2)
        _close(gemm_triton(x, w, b), F.linear(x, w, b), 1e-2)
    # K steps wider than what divides K (576 = 2 x 256 + 64): the last step's columns past K masked
    w = torch.randn(32, 576, generator=g).to(torch.bfloat16)
    x = torch.randn(8, 576, generator=g).to(torch.bfloat16)
    for cut in ((16, 256, 3, 4), (32, 128, 4, 4), (16, 512, 2, 4)):
        _close(gemm_triton(x, w, None, cut), F.linear(x, w), 1e-2)
    import fusedserve.models.layers.linear_triton as lt

    lt.MASKED_K_STEPS = True  # the A/B's other side: 128-wide steps at a small model's K that 128 does not divide
    try:
        assert decode_gemm_tile(8, 960, 576) == (64, 128, 4, 4) and decode_gemm_tile(17, 960, 576) == (64, 64, 6, 4)
        assert decode_gemm_tile(8, 576, 1536) == (16, 2048, 1, 4) and decode_gemm_tile(8, 4096, 4096) == (64, 128, 6, 4)
        w = torch.randn(64, 576, generator=g).to(torch.bfloat16)
        _close(decode_linear(x, w), F.linear(x, w), 1e-2)
    finally:
        lt.MASKED_K_STEPS = False
    # the one tile as slices in two batched dots (ONE_TILE_SLICES, by default (64, 4) over K 1024..2048, the
    # shapes above): with 8 warps and K 576 too, 576 = 8 + 1 slices of 64, 1536 = 16 + 8, 1728 = 16 + 11 (of 16,
    # the rest masked); with an epilogue too
    assert lt.ONE_TILE_SLICES == (64, 4) and lt.one_tile_slices(1536, 64) == (16, 8)
    assert lt._slice_k(576, 1536) == 64 and lt._slice_k(24576, 1536) == 0 and lt._slice_k(576, 1100) == 0
    before = lt.ONE_TILE_SLICES, lt.ONE_TILE_K_MIN
    lt.ONE_TILE_SLICES, lt.ONE_TILE_K_MIN = (64, 8), 512
    try:
        assert lt.one_tile_slices(576, 64) == (8, 1) and lt.one_tile_slices(1728, 64) == (16, 16)
        assert decode_gemm_tile(8, 960, 576) == (16, 1024, 1, 8) and decode_gemm_tile(8, 960, 600) == (16, 1024, 1, 4)
        for m, n, k in ((8, 32, 576), (3, 16, 1536), (16, 16, 1728)):
            w = torch.randn(n, k, generator=g).to(torch.bfloat16)
            b = torch.randn(n, generator=g).to(torch.bfloat16)
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            _close(gemm_triton(x, w, b), F.linear(x, w, b), 1e-2)
        _check_gate_up_silu(lt.decode_gate_up_silu, 5, 64, 576, False, g)
        _check_qkv_rope(lt.decode_qkv_rope, 5, 64, 9, 3, 576, True, g)  # SmolLM2's heads, RoPE in the epilogue
    finally:
        lt.ONE_TILE_SLICES, lt.ONE_TILE_K_MIN = before
    # split-K (few output tiles): both K halves summed by the tile's last program; counts back at 0
    import fusedserve.models.layers.arrival_counters as arrival

    cpu = torch.device("cpu")
    assert lt.decode_gemm_splits(64, 256, (64, 128, 6, 4), cpu) == 2 and lt.decode_gemm_splits(4096, 4096, (64, 128, 6, 4), cpu) == 2
    assert lt.decode_gemm_splits(6144, 4096, (64, 128, 6, 4), cpu) == 1 and lt.decode_gemm_splits(64, 128, (64, 128, 6, 4), cpu) == 1
    assert lt.decode_gemm_splits(4096, 14336, (64, 128, 6, 4), cpu) == 2
    # L2 prefetch before the wait: a small model's K at <= 16 rows (SmolLM2's 576: 9 lines, padded to 16), and,
    # with L2_PREFETCH_WEIGHT_BYTES, a weight that fits it at up to 64 rows (Llama-3-8B's o_proj, split 2 ways:
    # 2048 columns = 32 lines) but not a bigger one (qkv, 50 MB); never the one tile
    assert lt.L2_PREFETCH_WEIGHT_BYTES == 0 and lt.prefetch_lines(64, 4096, 4096, 2, 128, 2) == 0
    assert lt.prefetch_lines(8, 960, 576, 1, 64, 2) == 16 and lt.prefetch_lines(17, 960, 576, 1, 64, 2) == 0
    assert lt.prefetch_lines(8, 576, 1536, 1, 2048, 2) == 0
    before_bytes, lt.L2_PREFETCH_WEIGHT_BYTES = lt.L2_PREFETCH_WEIGHT_BYTES, 40_000_000
    try:
        assert lt.prefetch_lines(64, 4096, 4096, 2, 128, 2) == 32 and lt.prefetch_lines(64, 6144, 4096, 1, 128, 2) == 0
        assert lt.prefetch_lines(65, 4096, 4096, 2, 128, 2) == 0
    finally:
        lt.L2_PREFETCH_WEIGHT_BYTES = before_bytes
    for m, n, k in ((3, 128, 512), (40, 64, 256)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        b = torch.randn(n, generator=g).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        split = gemm_triton(x, w, b)
        _close(split, F.linear(x, w, b), 1e-2)
        assert int(arrival._COUNTERS[cpu].abs().sum()) == 0
    w = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    x = torch.randn(65, 128, generator=g).to(torch.bfloat16)  # more rows than the kernel takes
    assert torch.equal(decode_linear(x, w), F.linear(x, w))
    assert torch.equal(gemm_triton(x[:4].float(), w.float()), F.linear(x[:4].float(), w.float()))  # fp32: cuBLAS


def _check_gate_up_silu(fn: Callable[..., torch.Tensor], m: int, inter: int, k: int, bias: bool,
                        g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``fn`` (a gate-up + SiLU-and-mul) on random [m, k] rows equals F.linear then the reference.
    -> (x, w, b) it drew."""
    import torch.nn.functional as F

    from fusedserve.models.layers.mlp import silu_and_mul

    w = torch.randn(2 * inter, k, generator=g).to(torch.bfloat16)
    b = torch.randn(2 * inter, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    want = silu_and_mul(F.linear(x.float(), w.float(), None if b is None else b.float())).to(torch.bfloat16)
    _close(fn(x, w, b), want, 1e-2)
    return x, w, b


def _check_qkv_rope(fn: Callable[..., tuple[torch.Tensor, ...]], m: int, head_dim: int, heads: int, kv_heads: int,
                    k: int, bias: bool, g: torch.Generator) -> None:
    """``fn`` (a qkv projection with q / k rotated) on random [m, k] rows at random positions equals F.linear
    then the RoPE reference."""
    import torch.nn.functional as F

    from fusedserve.models.layers.rotary import rope_inv_freq, rope_reference

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    w = torch.randn(q_size + 2 * kv_size, k, generator=g).to(torch.bfloat16)
    b = torch.randn(q_size + 2 * kv_size, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 5000, (m, 2), generator=g)[:, 1]  # a strided view (read at its stride)
    inv_freq = rope_inv_freq(head_dim, 500000.0, None)
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    q, k_, v = y.split([q_size, kv_size, kv_size], dim=-1)
    q_want, k_want = rope_reference(positions, q.view(m, heads, head_dim), k_.view(m, kv_heads, head_dim), inv_freq)
    got = fn(x, w, b, positions, inv_freq, q_size, kv_size)
    for part, ref in zip(got, (q_want.reshape(m, q_size), k_want.reshape(m, kv_size), v), strict=True):
        _close(part, ref.to(torch.bfloat16), 1e-2)


@inner
def test_interp_decode_gemm_epilogues_equal_the_ops_after_a_matmul() -> None:
    """The decode GEMM finishing the next op on its fp32 sums: silu(gate) * up over [gate; up] rows, and q /
    k's rotate-half RoPE over tiles of partner rows (v left as it is) equal F.linear then the references
    (the fused ops round once, the references twice: bf16 distance), with and without split K and a bias;
    one row, more than GEMM_ROWS rows or a head the tile does not hold go through the separate kernels."""
    import torch.nn.functional as F

    from fusedserve.models.layers.linear_triton import decode_gate_up_silu, decode_qkv_rope
    from fusedserve.models.layers.mlp import silu_and_mul

    g = torch.Generator().manual_seed(11)
    for m, inter, k, bias in ((2, 64, 256, False), (17, 128, 128, True), (64, 96, 256, False), (1, 64, 128, True),
                              (65, 64, 128, False), (3, 32, 1100, True)):
        _check_gate_up_silu(decode_gate_up_silu, m, inter, k, bias, g)
    for m, head_dim, heads, kv_heads, k, bias in ((3, 64, 4, 2, 128, False), (16, 128, 2, 1, 256, True),
                                                  (40, 64, 3, 1, 128, False), (1, 64, 2, 1, 128, False),
                                                  (8, 32, 4, 2, 128, False), (5, 64, 2, 1, 1152, True)):
        _check_qkv_rope(decode_qkv_rope, m, head_dim, heads, kv_heads, k, bias, g)
    # split K (o_proj's shape class: few tiles) with the SwiGLU epilogue; counts back at 0
    import fusedserve.models.layers.arrival_counters as arrival
    import fusedserve.models.layers.linear_triton as lt

    w = torch.randn(128, 512, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    assert lt.decode_gemm_splits(128, 512, (64, 128, 6, 4), torch.device("cpu")) == 2
    _close(decode_gate_up_silu(x, w), silu_and_mul(F.linear(x.float(), w.float())).to(torch.bfloat16), 1e-2)
    assert int(arrival._COUNTERS[torch.device("cpu")].abs().sum()) == 0


@inner
def test_interp_gemv_epilogues_equal_the_ops_after_a_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row (``GEMV_EPILOGUES``): the GEMV finishing SwiGLU over [gate; up] rows, or RoPE over the qkv
    projection's rotate-half partners, in its epilogue equals F.linear then the references, with and without a
    bias, K in one masked tile (576) or even tiles; no separate RoPE / SiLU-and-mul kernel runs."""
    import torch.nn.functional as F

    import fusedserve.models.layers.linear_triton as lt
    from fusedserve.models.layers import rope_triton, silu_mul_triton

    def refuse(*args: object) -> None:
        raise AssertionError("a separate kernel ran")

    monkeypatch.setattr(lt, "GEMV_EPILOGUES", True)
    monkeypatch.setattr(silu_mul_triton, "silu_and_mul_triton", refuse)
    monkeypatch.setattr(rope_triton, "rope_triton", refuse)
    g = torch.Generator().manual_seed(17)
    for inter, k, bias in ((64, 576, False), (96, 256, True)):
        x, w, b = _check_gate_up_silu(lt.decode_gate_up_silu, 1, inter, k, bias, g)
        _close(lt.decode_linear(x, w, b), F.linear(x.float(), w.float(), None if b is None else b.float()).to(
            torch.bfloat16), 1e-2)
    for head_dim, heads, kv_heads, k, bias in ((64, 3, 1, 576, False), (128, 2, 1, 256, True), (32, 4, 2, 128, False)):
        _check_qkv_rope(lt.decode_qkv_rope, 1, head_dim, heads, kv_heads, k, bias, g)


@inner
def test_interp_argmax_equals_torch() -> None:
    """Greedy sampling's argmax (``argmax_triton``: row chunks, then the chunks' winners) picks torch's index:
    the first of equal maxima within a chunk and across chunks, a masked last chunk, bf16 and fp32 rows,
    a strided view (torch's own)."""
    from fusedserve.models.layers import argmax_triton as am

    g = torch.Generator().manual_seed(9)
    vocab = 3 * am.BLOCK + 77
    x = torch.randn(5, vocab, generator=g)
    x[1, 5] = x[1, 9] = 50.0  # a tie inside the first chunk
    x[2, 100] = x[2, 2 * am.BLOCK + 3] = 60.0  # a tie across chunks
    x[3, vocab - 1] = 70.0  # the masked last chunk's last column
    x[4] = 1.0  # all equal: index 0
    for t in (x, x.to(torch.bfloat16)):
        assert torch.equal(am.argmax_triton(t), t.argmax(dim=-1))
    assert torch.equal(am.argmax_triton(x[:, ::2]), x[:, ::2].argmax(dim=-1))
    # through a table (an EAGLE3 draft's draft-to-target ids): one program a row up to ONE_PROGRAM, else chunks
    from fusedserve.models.layers.draft_input import argmax_to

    table = torch.randperm(vocab, generator=g) * 3
    for t in (x, x.to(torch.bfloat16), x[:, : am.BLOCK + 5]):
        tab = table[: t.shape[1]].contiguous()
        assert torch.equal(am.argmax_to_triton(t, tab), argmax_to(t, tab))
    wide = torch.randn(2, am.ONE_PROGRAM + 9, generator=g)
    wide[1, am.ONE_PROGRAM + 3] = 99.0
    tab = torch.arange(wide.shape[1]) + 7
    assert torch.equal(am.argmax_to_triton(wide, tab), argmax_to(wide, tab))


@inner
@pytest.mark.parametrize("block_size", [0, 4], ids=["this-round", "next-verify-staged"])
@pytest.mark.parametrize("stage", [True, False], ids=["staged", "verdict-only"])
def test_interp_verify_stage_equals_the_torch_program(stage: bool, block_size: int) -> None:
    """A chain verify's program after its argmax in one launch (``verify_stage_triton``): the aux states side by
    side, the verdict (drafts, argmax, greedy count) and the draft's staged first pass (ids, positions + 1,
    slots, index, context lengths, block tables, hidden rows, rows to drop) equal the torch program's, for all
    drafts accepted, some, none, and a padding sequence (its last row on the pad slot: nothing dropped); with the
    block size given, so do the verify's own inputs staged for the round after it (``stage_next_verify``)."""
    from dataclasses import replace

    from fusedserve.models.interface import ModelOutput
    from fusedserve.worker.executor.step_graphs import StaticInputs
    from fusedserve.worker.executor.step_shape import StepShape
    from fusedserve.worker.spec_decode.verify_program import VerifyProgram
    from fusedserve.worker.spec_decode.verify_stage_triton import verify_stage_triton

    g = torch.Generator().manual_seed(21)
    b, q, width, blocks, pad = 4, 8, 40, 5, 999
    rows = b * q

    def inputs(fill: bool) -> StaticInputs:
        meta = torch.randint(0, 500, (4 * rows + b + b * blocks + b,), generator=g) if fill else \
            torch.full((4 * rows + b + b * blocks + b,), -1, dtype=torch.long)
        ids, pos, slots, index, ctx, tables, drop = meta.split([rows, rows, rows, rows, b, b * blocks, b])
        hidden = torch.randn(rows, 3 * width, generator=g).to(torch.bfloat16) if fill else \
            torch.zeros(rows, 3 * width, dtype=torch.bfloat16)
        return StaticInputs(ids, pos, slots, index, ctx, tables.view(b, blocks), hidden, drop, pad, block_size)

    verify = inputs(True)
    verify.slots.view(b, q)[3] = pad  # a padding sequence
    argmax = torch.randint(0, 50, (rows,), generator=g)
    ids = verify.ids.view(b, q)
    targets = argmax.view(b, q)
    ids[0, 1:] = targets[0, :-1]  # every draft accepted
    ids[1, 1:] = targets[1, :-1]
    ids[1, 3] = targets[1, 2] + 1  # two accepted
    ids[2, 1] = targets[2, 0] + 1  # none
    hidden = tuple(torch.randn(rows, width, generator=g).to(torch.bfloat16) for _ in range(3))
    out = ModelOutput(torch.zeros(rows, 7), hidden)
    shape = StepShape(batch=b, tokens=q)
    verify.index.view(b, q)[:] = torch.arange(q) + torch.tensor([3, 0, 9, 0])[:, None]  # contexts of 3 + q, ...
    verify.context_lens[:] = verify.index.view(b, q)[:, -1] + 1
    before = {name: getattr(verify, name).clone() for name in ("ids", "positions", "slots", "index", "context_lens")}
    drafts = [inputs(False), inputs(False)]
    verifies = [replace(verify, **{name: t.clone() for name, t in before.items()}) for _ in drafts]
    results = []
    for kernel, draft, v in zip((None, verify_stage_triton), drafts, verifies, strict=True):
        program = VerifyProgram(lambda logits: argmax, lambda batch, d=draft: d if stage else None, kernel)
        results.append((program(shape, v, out), draft))
    (aux, verdict), _ = results[0]
    assert verdict[:3, -1].tolist() == [7, 2, 0]
    for (want, want_d), (got, got_d) in [(results[0], results[1])]:
        for w, x in zip(want, got, strict=True):
            assert torch.equal(w, x)
        for name in ("ids", "positions", "slots", "index", "context_lens", "tables", "hidden", "drop"):
            assert torch.equal(getattr(want_d, name), getattr(got_d, name)), name
    for name, was in before.items():  # the verify's own inputs: this round's kept, or the next round's staged
        assert torch.equal(getattr(verifies[0], name), getattr(verifies[1], name)), name
        assert torch.equal(getattr(verifies[0], name), was) == (block_size == 0), name
    if block_size:
        staged = verifies[0]
        assert staged.ids.view(b, q)[:3, 0].tolist() == [targets[0, 7], targets[1, 2], targets[2, 0]]
        assert staged.context_lens.tolist() == [3 + q + 8, q + 3, 9 + q + 1, before["context_lens"][3]]
        at = staged.index.view(b, q)[1]  # sequence 1 moved on by its 2 drafts and the token after them
        assert at.tolist() == list(range(3, 3 + q))
        assert staged.slots.view(b, q)[1].tolist() == [int(verify.tables[1, i // 4]) * 4 + i % 4 for i in at.tolist()]
        assert staged.slots.view(b, q)[3].tolist() == [pad] * q
    if stage:
        assert results[1][1].drop.tolist() == [0, 5, 7, 0]
    # the kernel took these inputs itself (no fallback to the torch program)
    assert verify_stage_triton(argmax, verify, hidden, b, q, drafts[1] if stage else None) is not None


@inner
@pytest.mark.parametrize(("n", "depth", "block_size"), [(16, 6, 4), (8, 3, 4), (4, 6, 4), (16, 6, 0)],
                         ids=["t16-s6", "t8-s3", "t4-s6-shallow", "t16-this-round"])
def test_interp_tree_stage_equals_the_torch_program(n: int, depth: int, block_size: int) -> None:
    """A tree verify's program after its argmax in one launch (``tree_stage_triton``): the aux states, the verdict
    (tokens, parents read off the masks, argmax, count), the K/V moves, the draft's staged first pass (tokens gained,
    positions, slots, index, context, tables, the accepted nodes' aux rows, rows to drop) and the verify's own inputs
    for the next round equal the torch program's (``TreeVerifyProgram``), for a deep path through later siblings
    (siblings sharing a token: the lowest index wins), none accepted, one level, and a padding sequence; a tree
    shallower than the draft's depth (4 nodes, depth 6) too."""
    from dataclasses import replace

    from fusedserve.models.interface import ModelOutput
    from fusedserve.worker.executor.step import ancestor_mask
    from fusedserve.worker.executor.step_graphs import StaticInputs
    from fusedserve.worker.executor.step_shape import StepShape
    from fusedserve.worker.spec_decode.draft_tree import DraftTree, accept_greedy
    from fusedserve.worker.spec_decode.tree_stage_triton import tree_stage_triton
    from fusedserve.worker.spec_decode.tree_verify_program import TreeVerifyProgram

    g = torch.Generator().manual_seed(n * 10 + depth)
    b, width, blocks, pad = 4, 40, 9, 999
    rows, q = b * n, depth + 1
    parents = []
    for _ in range(b):  # random trees at most ``depth`` deep, parents first
        par, dep = [-1], [0]
        for i in range(1, n):
            p = int(torch.randint(0, i, (1,), generator=g))
            while dep[p] >= depth:
                p = par[p]
            par.append(p)
            dep.append(dep[p] + 1)
        parents.append(par)
    tokens = torch.randint(0, 50, (b, n), generator=g)
    argmax = torch.randint(50, 100, (b, n), generator=g)  # no child matches unless set below
    deepest = max(range(n), key=lambda i: (len([a for a in _ancestors(parents[0], i)]), i))
    for child in _ancestors(parents[0], deepest)[::-1][1:] + [deepest]:  # sequence 0: the path to its deepest node
        argmax[0, parents[0][child]] = tokens[0, child]
        for sib in range(1, child):  # an earlier sibling with the same token would win: give it another
            if parents[0][sib] == parents[0][child]:
                tokens[0, sib] = tokens[0, child] + 1
    first = _ancestors(parents[0], deepest)[-2]  # the path's root child
    for later in range(first + 1, n):  # and a later sibling sharing its token (it loses: the lowest index wins)
        if parents[0][later] == 0:
            tokens[0, later] = tokens[0, first]
            break
    kids2 = [c for c in range(1, n) if parents[2][c] == 0]
    argmax[2, 0] = tokens[2, kids2[-1]]  # sequence 2: one level (its last root child)
    for c in kids2[:-1]:
        tokens[2, c] = tokens[2, kids2[-1]] + 1
    mask = torch.tensor([ancestor_mask(p) for p in parents]).view(b, n, n)

    def inputs(fill: bool) -> StaticInputs:
        size = 4 * rows + b + b * blocks + b
        meta = torch.randint(0, 500, (size,), generator=g) if fill else torch.full((size,), -1, dtype=torch.long)
        ids, pos, slots, index, ctx, tables, drop = meta.split([rows, rows, rows, rows, b, b * blocks, b])
        hidden = torch.randn(rows, 3 * width, generator=g).to(torch.bfloat16) if fill else \
            torch.zeros(rows, 3 * width, dtype=torch.bfloat16)
        tail = mask.reshape(rows, n).long() if fill else None
        return StaticInputs(ids, pos, slots, index, ctx, tables.view(b, blocks), hidden, drop, pad, block_size, tail)

    verify = inputs(True)
    verify.ids.view(b, n).copy_(tokens)
    starts = torch.tensor([3, 0, 9, 0])
    verify.index.view(b, n)[:] = torch.arange(n) + starts[:, None]
    verify.positions.view(b, n)[:] = starts[:, None] + torch.tensor([[len(_ancestors(p, i)) - 1 for i in range(n)]
                                                                      for p in parents])
    verify.context_lens[:] = starts + n
    verify.tables.copy_(torch.randperm(240, generator=g)[:b * blocks].view(b, blocks))
    verify.slots.view(b, n)[:] = verify.tables.gather(1, verify.index.view(b, n) // 4) * 4 + verify.index.view(b, n) % 4
    verify.slots.view(b, n)[3] = pad  # a padding sequence
    hidden = tuple(torch.randn(rows, width, generator=g).to(torch.bfloat16) for _ in range(3))
    out = ModelOutput(torch.zeros(rows, 7), hidden)
    shape = StepShape(batch=b, tokens=n, tail=n)
    names = ("ids", "positions", "slots", "index", "context_lens")
    before = {name: getattr(verify, name).clone() for name in names}
    drafts = [inputs(False), inputs(False)]
    drafts = [replace(d, ids=torch.full((b * q,), -1), positions=torch.full((b * q,), -1),
                      slots=torch.full((b * q,), -1), index=torch.full((b * q,), -1),
                      hidden=torch.zeros(b * q, 3 * width, dtype=torch.bfloat16)) for d in drafts]
    verifies = [replace(verify, **{name: t.clone() for name, t in before.items()}) for _ in drafts]
    results = []
    for kernel, draft, v in zip((None, tree_stage_triton), drafts, verifies, strict=True):
        program = TreeVerifyProgram(lambda logits: argmax.reshape(-1), lambda batch, d=draft: d, depth, kernel)
        results.append(program(shape, v, out))
    want, got = results
    host = [accept_greedy(DraftTree(tuple(tokens[i].tolist()), tuple(parents[i])), argmax[i].tolist())
            for i in range(3)]
    assert want[1][:3, -1].tolist() == [a.num_accepted for a in host]
    assert host[0].num_accepted == min(depth, len(_ancestors(parents[0], deepest)) - 1) and host[1].num_accepted == 0
    assert host[2].num_accepted == 1
    for w, x in zip(want, got, strict=True):
        assert torch.equal(w, x)
    for name in ("ids", "positions", "slots", "index", "context_lens", "tables", "hidden", "drop"):
        assert torch.equal(getattr(drafts[0], name), getattr(drafts[1], name)), name
    for name, was in before.items():
        assert torch.equal(getattr(verifies[0], name), getattr(verifies[1], name)), name
        assert torch.equal(getattr(verifies[0], name), was) == (block_size == 0), name
    if block_size:
        assert drafts[0].drop.tolist() == [depth - host[0].num_accepted, depth, depth - 1, 0]
        assert drafts[0].ids.view(b, q)[0, :host[0].num_accepted + 1].tolist() == list(host[0].tokens)
    assert tree_stage_triton(argmax.reshape(-1), verify, hidden, b, n, depth, drafts[1]) is not None


def _ancestors(parents: list[int], node: int) -> list[int]:
    """``node`` and its ancestors up to the root, nearest first."""
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


@inner
@pytest.mark.parametrize(("q", "chain", "leaves"), [(8, 6, 1), (6, 7, 1), (1, 3, 1), (7, 5, 4), (4, 2, 3)])
def test_interp_first_pass_layout_in_one_launch_equals_the_torch_layout(q: int, chain: int, leaves: int) -> None:
    """``chain_layout_triton.first_pass_triton`` (one launch) equals ``chain_layout.first_pass`` (torch): three
    sequences of ``q`` packed rows dropping 0, all but one and some of them (the front rows copies of the first
    real row), a padding sequence on the pad slot, hidden inputs 1 728 wide (two column blocks), and the chain
    steps after the last rows crossing a page of the block tables; a tree's steps of ``leaves`` rows too."""
    from fusedserve.worker.executor.chain_layout import first_pass
    from fusedserve.worker.executor.chain_layout_triton import first_pass_triton

    g = torch.Generator().manual_seed(q * 10 + chain)
    b, page, width, pad_slot = 4, 4, 11, 191  # block 47 holds the pad slot
    tables = torch.randperm(47, generator=g)[: b * width].view(b, width).long()
    ctx = torch.tensor([30 - (leaves - 1) * chain, 9, 2 + q, 1])  # (a tree's steps within the tables too)
    drop = torch.tensor([0, q - 1, min(2, q - 1), 0])
    index = torch.cat([c - q + torch.arange(q) for c in ctx.tolist()[:3]] + [torch.zeros(q, dtype=torch.long)])
    positions = index + 3
    slots = torch.cat([tables[i, index[i * q:(i + 1) * q] // page] * page + index[i * q:(i + 1) * q] % page
                       for i in range(3)] + [torch.full((q,), pad_slot)])
    ids = torch.randint(0, 1000, (b * q,), generator=g)
    hidden = torch.randn(b * q, 1728, generator=g).to(torch.bfloat16)
    args = (ids, positions, slots, index, ctx, hidden, drop, tables, q, chain, page, pad_slot)
    want = first_pass(*args, (torch.arange(q), torch.arange(b), torch.arange(b) * q + q - 1), leaves=leaves)
    got = first_pass_triton(*args, leaves=leaves)
    for name in ("ids", "positions", "slots", "index", "hidden", "context_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("positions", "index", "context_lens", "slots"):
        assert torch.equal(getattr(got.steps, name), getattr(want.steps, name)), name
    per_seq = want.steps.slots.view(chain, b, leaves)
    assert (per_seq[:, 3] == pad_slot).all() and (per_seq[:, :3] != pad_slot).all()


@inner
def test_interp_embedding_equals_the_reference() -> None:
    """The token embedding's rows in one kernel (``embedding_triton``): each id's row of this rank's vocab shard,
    zeros for ids outside it, equal ``embedding_lookup`` bit for bit (a copy), for the first shard, a later one
    (ids below and above it) and a width past one column block (SmolLM2's 576; 1536 over two)."""
    from fusedserve.models.layers.embedding_triton import embedding_triton
    from fusedserve.models.layers.vocab_embedding import embedding_lookup

    g = torch.Generator().manual_seed(5)
    for width, dtype, start in ((576, torch.bfloat16, 0), (1536, torch.bfloat16, 64), (40, torch.float32, 32)):
        table = torch.randn(64, width, generator=g).to(dtype)
        ids = torch.tensor([0, 63, 5, start, start + 63, start + 64, max(start - 1, 0), 17, 17])
        want = embedding_lookup(ids, table, start)
        got = embedding_triton(ids, table, start)
        assert got.shape == (ids.shape[0], width) and got.dtype == dtype
        assert torch.equal(got, want)
        if start:
            assert not want[[0, 2, 5]].any() and want[3].equal(table[0])  # another rank's ids: zeros


@inner
def test_interp_draft_input_equals_the_ops() -> None:
    """An EAGLE3 draft step's input row in one kernel (``draft_input_triton``): the token's embedding and the
    hidden state, each RMS-normed, side by side, equal the reference (bf16: the same rounding steps; a width
    that is no power of two, SmolLM2's 576)."""
    from fusedserve.models.layers.draft_input import draft_input
    from fusedserve.models.layers.draft_input_triton import draft_input_triton

    g = torch.Generator().manual_seed(13)
    for width, dtype in ((576, torch.bfloat16), (64, torch.float32)):
        table = torch.randn(100, width, generator=g).to(dtype)
        hidden = (3 * torch.randn(5, width, generator=g)).to(dtype)
        we, wh = (torch.rand(width, generator=g) + 0.5).to(dtype), (torch.rand(width, generator=g) + 0.5).to(dtype)
        ids = torch.tensor([[3, 99, 0, 3, 42], [7] * 5]).t().contiguous()[:, 0]  # a column of drafts: a strided view
        want = draft_input(ids, table, hidden, we, wh, 1e-5)
        got = draft_input_triton(ids, table, hidden, we, wh, 1e-5)
        assert got.shape == (5, 2 * width)
        _close(got, want, 2e-3 if dtype == torch.bfloat16 else 1e-5)


@inner
@pytest.mark.parametrize("group", [1, 4])
def test_interp_decode_attention_stores_kv_and_equals_torch(group: int) -> None:
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

    g = torch.Generator().manual_seed(group)
    block, kv_heads, dim, ctx = 4, 2, 16, [1, 7, 70]
    kv = KVCache.allocate({0: (kv_heads, dim)}, 40, block, torch.bfloat16)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(40, generator=g).tolist()
    tables = [perm[:1], perm[1:3], perm[3:21]]
    slots = [t[(c - 1) // block] * block + (c - 1) % block for t, c in zip(tables, ctx)]
    q = torch.randn(3, kv_heads * group, dim, generator=g).to(torch.bfloat16)
    qkv_k = torch.randn(3, 2 * kv_heads * dim, generator=g).to(torch.bfloat16)  # strided k, v as in a layer
    k, v = qkv_k[:, : kv_heads * dim].view(3, kv_heads, dim), qkv_k[:, kv_heads * dim:].view(3, kv_heads, dim)

    def batch(cache: KVCache) -> ForwardBatch:
        return ForwardBatch(torch.zeros(3, dtype=torch.long), torch.tensor(ctx) - 1, [1, 1, 1], ctx,
                            torch.tensor(slots), tables, cache)

    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, 40)
    got = paged_decode_attention_triton(q, k, v, 0, batch(kv), dim**-0.5)
    want = paged_attention_torch(q, k, v, 0, batch(ref_kv), dim**-0.5)
    _close(got, want, 1e-2)
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])


@inner
def test_interp_decode_attention_shares_the_real_context_among_its_splits() -> None:
    """A captured batch's block table is as wide as its longest possible context and its splits are fixed
    by that width; the kernel shares each sequence's real context out among them at run time. Every cut
    (keys per tile, splits: one, fewer than the tiles, more than the tiles; loads read ahead in registers
    or pipelined) equals the torch path."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
    from fusedserve.models.layers.decode_attention_triton import (
        DecodeLaunch,
        decode_attention_launch,
        decode_launch,
    )
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

    g = torch.Generator().manual_seed(21)
    block, kv_heads, group, dim, width = 4, 2, 4, 16, 64  # block tables of 64 pages: 256 slots each
    ctx = [1, 9, 70, 130]
    kv = KVCache.allocate({0: (kv_heads, dim)}, 160, block, torch.bfloat16)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(159, generator=g) + 1
    tables, used = torch.zeros(len(ctx), width, dtype=torch.int32), 0
    for i, c in enumerate(ctx):
        pages = -(-c // block)
        tables[i, :pages] = perm[used:used + pages]
        used += pages
    meta = PagedAttentionMetadata.decode(tables, torch.tensor(ctx, dtype=torch.int32))
    slots = torch.tensor([int(tables[i, (c - 1) // block]) * block + (c - 1) % block for i, c in enumerate(ctx)])
    q = torch.randn(len(ctx), kv_heads * group, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(len(ctx), kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(len(ctx), kv_heads, dim, generator=g).to(torch.bfloat16)

    def batch(cache: KVCache) -> ForwardBatch:
        zeros = torch.zeros(len(ctx), dtype=torch.long)
        return ForwardBatch(zeros, zeros, [1] * len(ctx), ctx, slots, [[0]] * len(ctx), cache, paged=meta)

    ref = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, 160)
    want = paged_attention_torch(q, k, v, 0, batch(ref), dim**-0.5)
    assert decode_launch(len(ctx) * kv_heads, width * block).splits > 1
    assert decode_launch(len(ctx) * kv_heads, width * block).prefetch  # 8 programs: read ahead in registers
    assert not decode_launch(64 * kv_heads, width * block).prefetch
    # Pipelined loads: one split, 8 splits of 32-key tiles, 3 stages; read ahead in registers: one split, fewer
    # splits than tiles, more splits than tiles (each cut once: the interpreter takes ~3 s a launch here).
    cuts = [(16, 2, 1, 1, False), (32, 4, 2, 8, False), (16, 2, 3, 2, False),
            (16, 2, 1, 1, True), (16, 2, 1, 4, True), (16, 2, 1, 16, True)]
    for launch in (*(DecodeLaunch(*c[:4], prefetch=c[4]) for c in cuts),
                   decode_launch(len(ctx) * kv_heads, width * block)):
        cache = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, 160)
        got = decode_attention_launch(q, k, v, 0, batch(cache), dim**-0.5, launch)
        _close(got, want, 1e-2)
        assert torch.equal(cache.k[0], ref.k[0]) and torch.equal(cache.v[0], ref.v[0]), launch
    # the splits combined by each tile's last program (arrival counts, back at 0) or by the combine kernel
    import fusedserve.models.layers.arrival_counters as arrival
    import fusedserve.models.layers.decode_attention_triton as decode_attention

    # (contexts of 1 and 9 tokens fit one split of 16 keys: its program writes them out, no partials)
    outs = {}
    for fused in (True, False):
        decode_attention.FUSED_COMBINE = fused
        cache = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, 160)
        outs[fused] = decode_attention_launch(q, k, v, 0, batch(cache), dim**-0.5, DecodeLaunch(16, 2, 1, 8))
    decode_attention.FUSED_COMBINE = True
    _close(outs[True], outs[False], 1e-3)
    _close(outs[True], want, 1e-2)
    assert int(arrival._COUNTERS[torch.device("cpu")].abs().sum()) == 0


@inner
def test_interp_llama_decode_with_triton_kernels_equals_reference() -> None:
    """A whole tiny Llama: prefill then a decode step, Triton kernel set vs the references (fp32)."""
    from transformers import LlamaConfig

    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import random_model

    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    logits = {}
    for name in ("reference", "triton"):
        model = random_model(config, ParallelGroups.single_rank(), Collectives("gloo"), seed=5,
                             kernels=Kernels.named(name))
        kv = KVCache.allocate(model.kv_shapes(), 4, 4, torch.float32)
        prompt = [3, 1, 4, 1, 5, 9]
        model(ForwardBatch.prefill([prompt], kv))
        step = ForwardBatch(torch.tensor([2]), torch.tensor([6]), [1], [7], torch.tensor([6]), [[0, 1]], kv)
        logits[name] = model(step).logits
    _close(logits["triton"], logits["reference"], 1e-4)


@inner
def test_interp_llama_bf16_decode_batch_with_fused_epilogues_is_close_to_reference() -> None:
    """Two sequences decoding in bf16 with head dims and widths the decode GEMM's tiles take, so RoPE and
    SiLU-and-mul run in the qkv / gate-up matmuls' epilogues (no rope or activation kernel launched): the
    logits stay within bf16 distance of the reference set's, and the greedy tokens agree."""
    from transformers import LlamaConfig

    import fusedserve.models.layers.rope_triton as rope_module
    import fusedserve.models.layers.silu_mul_triton as silu_module
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import random_model

    config = LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    logits = {}
    launched: list[str] = []
    rope, silu = rope_module.rope_triton, silu_module.silu_and_mul_triton
    for name in ("reference", "triton"):
        model = random_model(config, ParallelGroups.single_rank(), Collectives("gloo"), seed=5,
                             kernels=Kernels.named(name), dtype=torch.bfloat16)
        kv = KVCache.allocate(model.kv_shapes(), 8, 4, torch.bfloat16)
        model(ForwardBatch.prefill([[3, 1, 4, 1, 5, 9], [2, 7, 1, 8]], kv))
        step = ForwardBatch(torch.tensor([2, 6]), torch.tensor([6, 4]), [1, 1], [7, 5], torch.tensor([6, 12]),
                            [[0, 1], [2, 3]], kv)
        try:
            rope_module.rope_triton = lambda *a: (launched.append("rope"), rope(*a))[1]  # type: ignore[assignment]
            silu_module.silu_and_mul_triton = lambda x: (launched.append("silu"), silu(x))[1]  # type: ignore[assignment]
            logits[name] = model(step).logits.float()
        finally:
            rope_module.rope_triton, silu_module.silu_and_mul_triton = rope, silu
    assert launched == []
    _close(logits["triton"], logits["reference"], 3e-2)
    assert torch.equal(logits["triton"].argmax(-1), logits["reference"].argmax(-1))


@inner
def test_interp_decode_attention_pads_mla_head_dims() -> None:
    """K and V dims not powers of two (24 / 20), one KV head per query head (the layout of MLA's former
    expanded cache; the latent cache has its own tests below)."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

    g = torch.Generator().manual_seed(7)
    block, heads, kdim, vdim, ctx = 4, 3, 24, 20, [2, 9, 70]
    kv = KVCache.allocate({0: (heads, kdim, vdim)}, 40, block, torch.bfloat16)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(40, generator=g).tolist()
    tables = [perm[:1], perm[1:4], perm[4:22]]
    slots = [t[(c - 1) // block] * block + (c - 1) % block for t, c in zip(tables, ctx)]
    q = torch.randn(3, heads, kdim, generator=g).to(torch.bfloat16)
    k = torch.randn(3, heads, kdim, generator=g).to(torch.bfloat16)
    v = torch.randn(3, heads, vdim, generator=g).to(torch.bfloat16)

    def batch(cache: KVCache) -> ForwardBatch:
        return ForwardBatch(torch.zeros(3, dtype=torch.long), torch.tensor(ctx) - 1, [1, 1, 1], ctx,
                            torch.tensor(slots), tables, cache)

    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, 40)
    got = paged_decode_attention_triton(q, k, v, 0, batch(kv), kdim**-0.5)
    want = paged_attention_torch(q, k, v, 0, batch(ref_kv), kdim**-0.5)
    _close(got, want, 1e-2)
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])


# Prefill-shaped steps (query lens, context lens after the step, query heads, KV heads, K dim, V dim). The
# kernel's query tile is 64 rows (tokens x group): 16 tokens at group 4, 21 at group 3, 64 at group 1.
PREFILL_LAYOUTS = {
    "prompts-gqa4": ([21, 6], [21, 6], 8, 2, 16, 16),  # fresh prompts; 21 tokens: two tiles, the last partial
    "chunked-gqa3": ([25, 4], [40, 11], 6, 2, 16, 16),  # cached prefixes longer than the new tokens
    "mixed-gqa1": ([1, 9, 1, 70, 2], [13, 9, 1, 75, 5], 2, 2, 16, 16),  # decode rows beside prefill rows
    "kv-dims": ([6, 3], [6, 20], 3, 3, 24, 16),  # one KV head per query head, K 24 != V 16 (padded to 32)
}


@inner
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
def test_interp_prefill_attention_stores_kv_and_equals_reference(layout: str, dtype: torch.dtype) -> None:
    """Causal paged flash attention over padded block tables (3 spare columns) of scattered blocks equals
    the per-sequence reference, and leaves the cache as the reference does (the new K/V stored)."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.prefill_attention_triton import paged_prefill_attention_triton

    query_lens, context_lens, heads, kv_heads, kdim, vdim = PREFILL_LAYOUTS[layout]
    g = torch.Generator().manual_seed(len(layout))
    block, num_blocks, t = 4, 48, sum(query_lens)
    kv = KVCache.allocate({0: (kv_heads, kdim, vdim)}, num_blocks, block, dtype)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))  # cached prefixes (and stale slots)
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for q_len, c in zip(query_lens, context_lens):
        table, perm = perm[: -(-c // block)], perm[-(-c // block):]
        tables.append(table)
        slots += [table[p // block] * block + p % block for p in range(c - q_len, c)]
    width = max(len(tb) for tb in tables) + 3
    q = torch.randn(t, heads, kdim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, kdim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, vdim, generator=g).to(dtype)

    def batch(cache: KVCache, padded: bool) -> ForwardBatch:
        meta = PagedAttentionMetadata.from_lists(query_lens, context_lens, tables, max_blocks=width)
        return ForwardBatch(torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.long), query_lens,
                            context_lens, torch.tensor(slots), tables, cache, paged=meta if padded else None)

    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, num_blocks)
    got = paged_prefill_attention_triton(q, k, v, 0, batch(kv, True), kdim**-0.5)
    want = paged_attention_reference(q, k, v, 0, batch(ref_kv, False), kdim**-0.5)
    _close(got, want, 1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])


def _verify_layout(width: int, front: str, seed: int) -> tuple[Any, ...]:
    """A chain verify's batch as ``StepGraphs`` lays it out, GQA 8/2, head dim 16, 4-token pages: ``front`` "pad"
    or "copies": 3 sequences of 4 rows, real rows last (sequence 0: 4 real rows, context 9 in blocks [5, 2, 7];
    1: 2 real rows, context 6 in [3, 9]; 2: padding), the leading rows sharing the first real row's causal limit
    and writing the pad slot ("pad") or copying the first real row, its K/V to its slot (a first pass's dropped
    rows); block tables ``width`` wide. "long": contexts 140 / 37 / 6, 6 new rows each, shuffled pages; "mixed": a
    decode row, a 5-token chunk after 4 cached tokens and a 3-token prompt (contexts 20 / 9 / 3).
    -> (cache, a copy of it, q, k, v, batch(cache), the rows compared, the pad slot)"""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata

    g = torch.Generator().manual_seed(seed)
    block = 4
    if front in ("long", "mixed"):
        lens, ctx = ([6, 6, 6], [140, 37, 6]) if front == "long" else ([1, 5, 3], [20, 9, 3])
        n, pad_slot = max(lens), 239
        kv = KVCache.allocate({0: (2, 16)}, 60, block, torch.bfloat16)
        perm = torch.randperm(59, generator=g)
        tables, used = torch.zeros(3, width, dtype=torch.int32), 0
        for i, c in enumerate(ctx):
            tables[i, : -(-c // block)] = perm[used:used + -(-c // block)]
            used += -(-c // block)
        index = torch.tensor([c - q + j for q, c in zip(lens, ctx) for j in range(q)])
        slots = torch.tensor([int(tables[i, p // block]) * block + p % block for i, (q, c) in enumerate(zip(lens, ctx))
                              for p in range(c - q, c)])
    else:
        n, ctx, pad_slot = 4, [9, 6, 1], 47
        kv = KVCache.allocate({0: (2, 16)}, 12, block, torch.bfloat16)
        tables = torch.zeros(3, width, dtype=torch.int32)
        tables[0, :3] = torch.tensor([5, 2, 7])
        tables[1, :2] = torch.tensor([3, 9])
        lens = [n] * 3
        index = torch.tensor([5, 6, 7, 8, 4, 4, 4, 5, 0, 0, 0, 0])
        front_slot = pad_slot if front == "pad" else 36
        slots = torch.tensor([9, 10, 11, 28, front_slot, front_slot, 36, 37] + [pad_slot] * 4)  # block * 4 + offset
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    b, t = len(ctx), sum(lens)
    meta = PagedAttentionMetadata(
        block_tables=tables, context_lens=torch.tensor(ctx, dtype=torch.int32),
        token_seq=torch.arange(b).repeat_interleave(torch.tensor(lens)), token_index=index,
        query_start=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32), max_query_len=n)
    q = torch.randn(t, 8, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(t, 2, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(t, 2, 16, generator=g).to(torch.bfloat16)
    if front == "copies":
        q[4:6], k[4:6], v[4:6] = q[6], k[6], v[6]

    def batch(cache: KVCache) -> ForwardBatch:
        zeros = torch.zeros(t, dtype=torch.long)
        return ForwardBatch(zeros, zeros, lens, ctx, slots, [[0]] * b, cache, paged=meta)

    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, kv.num_blocks)
    real = t if front in ("long", "mixed") else 2 * n  # a padding sequence's rows are dropped
    return kv, ref_kv, q, k, v, batch, real, pad_slot


@inner
@pytest.mark.parametrize(("width", "front", "stores", "combines"), [
    (3, "pad", True, False), (3, "copies", True, False),  # one launch (unsplit: the split modes do not apply)
    (40, "pad", True, False), (40, "copies", True, False), (40, "pad", True, True), (40, "copies", True, True),
    (40, "pad", False, False), (40, "copies", False, False),  # 2 splits
], ids=["unsplit-pad", "unsplit-copies", "split-pad-stores", "split-copies-stores", "split-pad-stores-combines",
        "split-copies-stores-combines", "split-pad-write-then-combine", "split-copies-write-then-combine"])
def test_interp_prefill_attention_on_a_graph_padded_verify_layout_equals_torch(width: int, front: str, stores: bool,
                                                                               combines: bool) -> None:
    """StepGraphs' padded layout: every sequence 4 rows, real rows last; the leading rows share the first
    real row's causal limit and write the pad slot (``front`` "pad") or are copies of the first real row,
    its K/V to its slot (a first pass's dropped rows); a padding sequence's rows (dropped: only finite) see
    one slot of block 0, or with the kernel reading new keys from k / v its last row's key. Block
    tables 3 wide (one launch) or 40 (160 tokens: 2 splits, where the kernel stores the new K/V itself and
    reads them from k / v unless ``SPLIT_STORES_KV`` is off, and combines the splits itself with
    ``SPLIT_COMBINES``)."""
    from fusedserve.models.layers import prefill_attention_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

    kv, ref_kv, q, k, v, batch, real, pad_slot = _verify_layout(width, front, 11)
    before = prefill_attention_triton.SPLIT_STORES_KV, prefill_attention_triton.SPLIT_COMBINES
    prefill_attention_triton.SPLIT_STORES_KV, prefill_attention_triton.SPLIT_COMBINES = stores, combines
    try:
        got = prefill_attention_triton.paged_prefill_attention_triton(q, k, v, 0, batch(kv), 0.25)
    finally:
        prefill_attention_triton.SPLIT_STORES_KV, prefill_attention_triton.SPLIT_COMBINES = before
    want = paged_attention_torch(q, k, v, 0, batch(ref_kv), 0.25)
    assert torch.isfinite(got).all()
    _close(got[:real], want[:real], 1e-2)  # the padding sequence's rows are dropped
    assert torch.equal(kv.k[0][:pad_slot], ref_kv.k[0][:pad_slot])  # the pad slot: whichever row wrote last
    assert torch.equal(kv.v[0][:pad_slot], ref_kv.v[0][:pad_slot])


@inner
@pytest.mark.parametrize(("width", "front", "split_tiles"),
                         [(3, "pad", 4), (3, "copies", 4), (40, "pad", 4), (40, "copies", 4), (48, "long", 4),
                          (48, "long", 1), (8, "mixed", 4)],
                         ids=["one-split-pad", "one-split-copies", "splits-pad", "splits-copies", "pipelined-splits",
                              "rows-past-a-split", "mixed-rows"])
def test_interp_chain_verify_as_decode_rows_equals_torch(width: int, front: str, split_tiles: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A few new tokens per sequence (a chain verify) through the decode entry point run as decode rows, a
    program per sequence's rows (``ROWS_AS_DECODE``), not the prefill kernel: each row sees its sequence's cache up to its
    causal limit, the sequence's new keys from k / v. StepGraphs' padded layout (``front`` "pad": leading rows
    share the first real row's limit and write the pad slot; "copies": they copy the first real row, its K/V
    to its slot), block tables 3 wide (one split) or 40 (splits, read ahead in registers); "long":
    contexts 140 / 37 / 6 over 48-page tables, 6 rows each (the pipelined loop: FEW_PROGRAMS lowered below its 6
    programs; 4 splits combined in the kernel, the last one empty); "mixed": a decode row beside a chunk and a prompt. A program takes all of a
    sequence's rows; ``split_tiles`` 1 (``ROWS_SPLIT_TILES``: one-tile splits) leaves the first rows of the 37-token
    context no key in its last split. Equal to the torch path; the cache as the torch path leaves it; the
    arrival counters reset."""
    from fusedserve.models.layers import decode_attention_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

    def refuse(*args: object) -> None:
        raise AssertionError("a chain verify went to the prefill kernel")

    monkeypatch.setattr(decode_attention_triton, "paged_prefill_attention_triton", refuse)
    monkeypatch.setattr(decode_attention_triton, "ROWS_SPLIT_TILES", split_tiles)
    if front == "long":  # its 6 programs (3 sequences x 2 KV heads) through the pipelined loop
        monkeypatch.setattr(decode_attention_triton, "FEW_PROGRAMS", 4)
    kv, ref_kv, q, k, v, batch, real, pad_slot = _verify_layout(width, front, 17 + width)
    got = decode_attention_triton.paged_decode_attention_triton(q, k, v, 0, batch(kv), 0.25)
    again = decode_attention_triton.paged_decode_attention_triton(q, k, v, 0, batch(kv), 0.25)
    want = paged_attention_torch(q, k, v, 0, batch(ref_kv), 0.25)
    assert torch.isfinite(got).all()
    _close(got[:real], want[:real], 1e-2)
    assert torch.equal(got, again)
    assert torch.equal(kv.k[0][:pad_slot], ref_kv.k[0][:pad_slot])  # the pad slot: whichever row wrote last
    assert torch.equal(kv.v[0][:pad_slot], ref_kv.v[0][:pad_slot])


@inner
@pytest.mark.parametrize("rows", [6, 1])
def test_interp_tree_tail_masks_through_the_decode_entry_point_equal_torch(rows: int) -> None:
    """A captured tree step's layout: the metadata's tail mask ([T, 6]) over each context's last 6 indices.
    Sequence 0: a cached prefix of 94 then its tree (two key tiles); 1: the tree alone (context = tail);
    2: a padding sequence (every mask bit set, the pad slot). ``rows`` 6: a tree verify (decode rows); 1: a tree
    draft step of one new node per sequence (the prefill kernel). Equal to the torch path."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
    from fusedserve.worker.executor.step import ancestor_mask

    g = torch.Generator().manual_seed(13 + rows)
    block, num_blocks, tail, pad_slot = 4, 40, 6, 159
    ctx = [100, tail, tail]
    kv = KVCache.allocate({0: (2, 16)}, num_blocks, block, torch.bfloat16)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    tables = torch.zeros(3, 25, dtype=torch.int32)
    tables[0] = torch.arange(1, 26)
    tables[1, :2] = torch.tensor([30, 27])
    masks = []
    for i, parents in enumerate(((-1, 0, 0, 1, 2, 1), (-1, 0, 1, 2, 0, 4))):
        full = torch.tensor(ancestor_mask(parents)).view(tail, tail)
        masks.append(full[tail - rows:])  # the last `rows` nodes are new (a draft step: one)
    masks.append(torch.ones(rows, tail, dtype=torch.bool))
    index = [c - rows + j for c in ctx for j in range(rows)]
    meta = PagedAttentionMetadata(
        block_tables=tables, context_lens=torch.tensor(ctx, dtype=torch.int32),
        token_seq=torch.arange(3).repeat_interleave(rows), token_index=torch.tensor(index),
        query_start=torch.arange(4, dtype=torch.int32) * rows, max_query_len=rows, tail_mask=torch.cat(masks))
    slots = torch.tensor([int(tables[i, p // block]) * block + p % block for i in range(2)
                          for p in range(ctx[i] - rows, ctx[i])] + [pad_slot] * rows)
    t = 3 * rows
    q = torch.randn(t, 8, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(t, 2, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(t, 2, 16, generator=g).to(torch.bfloat16)

    def batch(cache: KVCache) -> ForwardBatch:
        zeros = torch.zeros(t, dtype=torch.long)
        return ForwardBatch(zeros, zeros, [rows] * 3, ctx, slots, [[0]] * 3, cache, paged=meta)

    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, num_blocks)
    got = paged_decode_attention_triton(q, k, v, 0, batch(kv), 0.25)
    want = paged_attention_torch(q, k, v, 0, batch(ref_kv), 0.25)
    assert torch.isfinite(got).all()
    _close(got[: 2 * rows], want[: 2 * rows], 1e-2)
    assert torch.equal(kv.k[0][:pad_slot], ref_kv.k[0][:pad_slot])


def _rows_step(ctx: list[int], rows: int, tables: torch.Tensor, block: int, tail: torch.Tensor | None, kv_heads: int,
               group: int, dim: int, g: torch.Generator) -> tuple[Any, ...]:
    """A step of ``rows`` new tokens per sequence, the last indices of each context (a verify; a tree's with its
    ``tail`` mask), random bf16 q / k / v. -> (q, k, v, batch(cache) -> its ForwardBatch)"""
    from fusedserve.models.forward_batch import ForwardBatch, PagedAttentionMetadata

    index = [c - rows + j for c in ctx for j in range(rows)]
    meta = PagedAttentionMetadata(
        block_tables=tables, context_lens=torch.tensor(ctx, dtype=torch.int32),
        token_seq=torch.arange(len(ctx)).repeat_interleave(rows), token_index=torch.tensor(index),
        query_start=torch.arange(len(ctx) + 1, dtype=torch.int32) * rows, max_query_len=rows, tail_mask=tail)
    slots = torch.tensor([int(tables[i, p // block]) * block + p % block for i, c in enumerate(ctx)
                          for p in range(c - rows, c)])
    t = len(ctx) * rows
    q = torch.randn(t, kv_heads * group, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(t, kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(t, kv_heads, dim, generator=g).to(torch.bfloat16)

    def batch(cache: Any) -> ForwardBatch:
        zeros = torch.zeros(t, dtype=torch.long)
        return ForwardBatch(zeros, zeros, [rows] * len(ctx), ctx, slots, [[0]] * len(ctx), cache, paged=meta)

    return q, k, v, batch


def _random_paged_cache(ctx: list[int], width: int, num_blocks: int, block: int, kv_heads: int, dim: int,
                        g: torch.Generator) -> tuple[Any, torch.Tensor]:
    """A bf16 cache of random K/V (layer 0) and block tables ``width`` wide giving each context its pages from a
    shuffle of blocks 1 .. num_blocks - 1. -> (cache, tables)"""
    from fusedserve.models.forward_batch import KVCache

    kv = KVCache.allocate({0: (kv_heads, dim)}, num_blocks, block, torch.bfloat16)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables, used = torch.zeros(len(ctx), width, dtype=torch.int32), 0
    for i, c in enumerate(ctx):
        pages = -(-c // block)
        tables[i, :pages] = perm[used:used + pages]
        used += pages
    return kv, tables


@inner
@pytest.mark.parametrize(("rows", "tail", "few"), [(6, 6, False), (6, 6, True), (4, 9, False), (16, 16, True)],
                         ids=["verify", "verify-read-ahead", "draft-step", "verify-16"])
def test_interp_tree_as_decode_rows_equals_torch(rows: int, tail: int, few: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree step of a few new nodes per sequence runs as decode rows, as a chain verify does, not through the
    prefill kernel: each row sees every index before its context's last ``tail`` and, of those, the ones its line
    of the tail mask names. Contexts 140 / 37 / ``tail`` (the tree alone) over 40-page tables (splits combined in
    the kernel); ``rows`` new nodes, the last of the tail (a verify: all of it; a draft step: 4 of 9, the earlier
    nodes cached); ``few``: the loop that reads ahead in registers. Equal to the torch path, the cache as it leaves
    it, and the same again (the arrival counters reset)."""
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers import decode_attention_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
    from fusedserve.worker.executor.step import ancestor_mask

    def refuse(*args: object) -> None:
        raise AssertionError("a tree step went to the prefill kernel")

    monkeypatch.setattr(decode_attention_triton, "paged_prefill_attention_triton", refuse)
    if few:
        monkeypatch.setattr(decode_attention_triton, "FEW_PROGRAMS", 8)
    g = torch.Generator().manual_seed(71 + rows + tail)
    block, width, kv_heads, group, dim = 4, 40, 2, 3, 16
    ctx = [140, 37, tail]
    kv, tables = _random_paged_cache(ctx, width, 100, block, kv_heads, dim, g)
    masks = []
    for _ in ctx:  # a random tree a sequence: each node's parent an earlier node
        parents = (-1, *(int(torch.randint(0, j, (1,), generator=g)) for j in range(1, tail)))
        masks.append(torch.tensor(ancestor_mask(parents)).view(tail, tail)[tail - rows:])
    q, k, v, batch = _rows_step(ctx, rows, tables, block, torch.cat(masks), kv_heads, group, dim, g)
    ref = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, 100)
    got = decode_attention_triton.paged_decode_attention_triton(q, k, v, 0, batch(kv), dim**-0.5)
    again = decode_attention_triton.paged_decode_attention_triton(q, k, v, 0, batch(kv), dim**-0.5)
    want = paged_attention_torch(q, k, v, 0, batch(ref), dim**-0.5)
    assert torch.isfinite(got).all()
    _close(got, want, 1e-2)
    assert torch.equal(got, again)
    assert torch.equal(kv.k[0], ref.k[0]) and torch.equal(kv.v[0], ref.v[0])


@inner
@pytest.mark.parametrize("tree", [False, True], ids=["chain-verify", "tree-verify"])
@pytest.mark.parametrize("combines", [False, True], ids=["combine-launch", "in-kernel"])
def test_interp_few_row_verify_splits_the_context_and_equals_torch(tree: bool, combines: bool) -> None:
    """A speculative verify has few query tiles, so the prefill kernel splits each context over several
    programs (split-KV, fixed by the block tables' width: 160 pages of 4 = 10 key tiles, 8 splits) and
    combines their partial softmax states. Contexts of 300 (the last split empty), 37 (one split's worth)
    and 6 (the new tokens alone); causal limits (a chain) or a tail mask (a tree). The splits combined by the
    launch after or in the kernel (``SPLIT_COMBINES``: the last of a tile's active splits; a context one split
    covers written out by that program alone). Equal to the torch path."""
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers import prefill_attention_triton
    from fusedserve.models.layers.attention_splits_triton import num_splits
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
    from fusedserve.models.layers.prefill_attention_triton import paged_prefill_attention_triton, tile_config
    from fusedserve.worker.executor.step import ancestor_mask

    g = torch.Generator().manual_seed(31 + tree)
    block, width, rows, kv_heads, group, dim = 4, 160, 6, 2, 3, 16
    ctx = [300, 37, rows]
    kv, tables = _random_paged_cache(ctx, width, 200, block, kv_heads, dim, g)
    tail = None
    if tree:
        full = torch.tensor(ancestor_mask((-1, 0, 0, 1, 2, 1))).view(rows, rows)
        tail = full.repeat(len(ctx), 1)
    q, k, v, batch = _rows_step(ctx, rows, tables, block, tail, kv_heads, group, dim, g)
    t = len(ctx) * rows
    tile_rows, block_h, block_n, _, _ = tile_config(group, 16, rows)
    assert num_splits((t // (tile_rows // block_h) + len(ctx)) * kv_heads, width * block, block_n) == 8
    ref = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, block, 200)
    before = prefill_attention_triton.SPLIT_COMBINES
    prefill_attention_triton.SPLIT_COMBINES = combines
    try:
        got = paged_prefill_attention_triton(q, k, v, 0, batch(kv), dim**-0.5)
        again = paged_prefill_attention_triton(q, k, v, 0, batch(kv), dim**-0.5)  # the arrival counters reset
    finally:
        prefill_attention_triton.SPLIT_COMBINES = before
    want = paged_attention_torch(q, k, v, 0, batch(ref), dim**-0.5)
    _close(got, want, 1e-2)
    assert torch.equal(got, again)
    assert torch.equal(kv.k[0], ref.k[0]) and torch.equal(kv.v[0], ref.v[0])


@inner
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_interp_prefill_and_chunked_prefill_with_triton_kernels_equal_reference(arch: str) -> None:
    """A whole tiny model (Llama: GQA 2; DeepSeek-V3: absorbed MLA over the latent cache, its 4 heads on one
    KV head of K 40 = latent 32 + rope 8, V = the latent) prefills two prompts, then extends one by a chunk
    over its cached prefix beside a decode row: Triton kernel set vs the references (fp32)."""
    from moe_blocks import copy_weights_folding_shared
    from transformers import DeepseekV3Config, LlamaConfig

    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import random_model
    from fusedserve.tiny import DEEPSEEK_V3_DEFAULTS

    if arch == "llama":
        config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    else:
        config = DeepseekV3Config(**{**DEEPSEEK_V3_DEFAULTS, "vocab_size": 100, "num_hidden_layers": 2,
                                     "v_head_dim": 16, "architectures": ["DeepseekV3ForCausalLM"]})
    logits = {}
    ref = None
    for name in ("reference", "triton"):
        model = random_model(config, ParallelGroups.single_rank(), Collectives("gloo"), seed=5,
                             kernels=Kernels.named(name))
        if ref is None:
            ref = model
        elif arch != "llama":  # the reference's weights; the triton set folds the shared expert into the MoE
            assert copy_weights_folding_shared(model, ref) == 2
        kv = KVCache.allocate(model.kv_shapes(), 8, 4, torch.float32)
        first = model(ForwardBatch.prefill([[3, 1, 4, 1, 5, 9], [2, 7, 1]], kv)).logits  # blocks [0, 1], [2]
        # Sequence 0 extends 6 -> 11 tokens (blocks 0, 1, 3), sequence 1 decodes its 4th token.
        step = ForwardBatch(torch.tensor([2, 6, 5, 3, 5, 8]), torch.tensor([6, 7, 8, 9, 10, 3]), [5, 1],
                            [11, 4], torch.tensor([6, 7, 12, 13, 14, 11]), [[0, 1, 3], [2]], kv)
        logits[name] = torch.cat([first, model(step).logits])
    _close(logits["triton"], logits["reference"], 1e-4)


# MLA's latent cache (KVShape(1, rank + rope, rank, v_in_k=True)): every query head on one KV head of
# [latent | rope], V = its first rank columns (not stored apart). (heads, kv_lora_rank, rope, dtype):
LATENT = {
    "group20-k40-fp32": (20, 32, 8, torch.float32),  # a group past 16 that is no power of two, tiny dims
    "group40-k576-fp32": (40, 512, 64, torch.float32),  # head blocks of 16 + 16 + 8 (decode), 32 + 8 (prefill)
    "group128-k576-bf16": (128, 512, 64, torch.bfloat16),  # DeepSeek-V3 at attention-TP 1
}


def _latent_step(query_lens: list[int], context_lens: list[int], heads: int, rank: int, rope: int,
                 dtype: torch.dtype, seed: int) -> tuple[KVCache, KVCache, Callable[..., ForwardBatch], torch.Tensor,
                                                        torch.Tensor, torch.Tensor]:
    """A step over a latent cache of scattered blocks (random cached rows): (cache, its copy, batch maker
    (cache, padded) -> batch with 3 spare block-table columns when padded, q, k, v = k's first columns)."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache, KVShape, PagedAttentionMetadata

    g = torch.Generator().manual_seed(seed)
    block, num_blocks, t = 4, sum(-(-c // 4) for c in context_lens) + 4, sum(query_lens)
    shape = KVShape(1, rank + rope, rank, v_in_k=True)
    kv = KVCache.allocate({0: shape}, num_blocks, block, dtype)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for q_len, c in zip(query_lens, context_lens):
        table, perm = perm[: -(-c // block)], perm[-(-c // block):]
        tables.append(table)
        slots += [table[p // block] * block + p % block for p in range(c - q_len, c)]
    width = max(len(tb) for tb in tables) + 3
    q = torch.randn(t, heads, rank + rope, generator=g).to(dtype)
    k = torch.randn(t, 1, rank + rope, generator=g).to(dtype)

    def batch(cache: KVCache, padded: bool = False) -> ForwardBatch:
        meta = PagedAttentionMetadata.from_lists(query_lens, context_lens, tables, max_blocks=width)
        return ForwardBatch(torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.long), query_lens,
                            context_lens, torch.tensor(slots), tables, cache, paged=meta if padded else None)

    ref = KVCache.allocate({0: shape}, num_blocks, block, dtype)
    ref.k[0].copy_(kv.k[0])
    return kv, ref, batch, q, k, k[..., :rank]


@inner
def test_interp_deepseek_v3_decode_with_triton_kernels_equals_reference() -> None:
    """A whole tiny DeepSeek-V3 (absorbed MLA, 16 heads on one latent KV head): two prompts prefilled, then
    two batched decode steps through the Triton decode kernel: Triton kernel set vs the references (fp32)."""
    from moe_blocks import copy_weights_folding_shared
    from transformers import DeepseekV3Config

    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import random_model
    from fusedserve.tiny import DEEPSEEK_V3_DEFAULTS

    config = DeepseekV3Config(**{**DEEPSEEK_V3_DEFAULTS, "vocab_size": 100, "num_hidden_layers": 2,
                                 "num_attention_heads": 16, "num_key_value_heads": 16,
                                 "architectures": ["DeepseekV3ForCausalLM"]})
    logits = {}
    ref = None
    for name in ("reference", "triton"):
        model = random_model(config, ParallelGroups.single_rank(), Collectives("gloo"), seed=6,
                             kernels=Kernels.named(name))
        if ref is None:
            ref = model
        else:  # the reference's weights; the triton set folds the shared expert into the MoE
            assert copy_weights_folding_shared(model, ref) == 2
        kv = KVCache.allocate(model.kv_shapes(), 8, 4, torch.float32)
        out = [model(ForwardBatch.prefill([[3, 1, 4, 1, 5, 9], [2, 7, 1]], kv)).logits]  # blocks [0, 1], [2]
        for i, tokens in enumerate(([2, 6], [8, 8])):  # contexts 7 / 4, then 8 / 5 (block 3 for sequence 1)
            out.append(model(ForwardBatch(torch.tensor(tokens), torch.tensor([6 + i, 3 + i]), [1, 1], [7 + i, 4 + i],
                                          torch.tensor([[6, 11], [7, 12]][i]), [[0, 1], [2, 3]], kv)).logits)
        logits[name] = torch.cat(out)
    _close(logits["triton"], logits["reference"], 1e-4)


@inner
@pytest.mark.parametrize("case", list(LATENT))
def test_interp_decode_attention_on_the_latent_cache_equals_reference(case: str) -> None:
    """Split-KV decode (contexts 2..200: 4 splits, their combine) over the latent cache: K alone stored,
    V read out of the K tiles, the group cut into head blocks; equals the per-sequence reference."""
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton

    heads, rank, rope, dtype = LATENT[case]
    ctx = [2, 9, 70, 200]
    kv, ref, batch, q, k, v = _latent_step([1] * 4, ctx, heads, rank, rope, dtype, seed=heads)
    got = paged_decode_attention_triton(q, k, v, 0, batch(kv, True), (rank + rope) ** -0.5)
    want = paged_attention_reference(q, k, v, 0, batch(ref), (rank + rope) ** -0.5)
    _close(got, want, 1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(kv.k[0], ref.k[0]) and kv.v[0].data_ptr() == kv.k[0].data_ptr()


@inner
@pytest.mark.parametrize("case", [c for c in LATENT if LATENT[c][0] < 128])
def test_interp_prefill_attention_on_the_latent_cache_equals_reference(case: str) -> None:
    """A fresh prompt, a chunk over a cached prefix, a decode row and a longer chunk in one step over the
    latent cache (padded block tables); the new rows' [latent | rope] stored and nothing else. Group 40 takes
    head blocks of 32 + 8; DeepSeek-V3's 128 heads (8 blocks of 16, the same code) are left to the GPU test
    (tests/test_gpu_mla_attention.py: a 1k prompt, a chunk and decode rows at 128 heads): here they took 36 s of
    the interpreter's bf16 dots even on short chunks."""
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.prefill_attention_triton import paged_prefill_attention_triton

    heads, rank, rope, dtype = LATENT[case]
    new, ctx = [6, 3, 1, 17], [6, 20, 33, 40]
    kv, ref, batch, q, k, v = _latent_step(new, ctx, heads, rank, rope, dtype, seed=rank)
    got = paged_prefill_attention_triton(q, k, v, 0, batch(kv, True), (rank + rope) ** -0.5)
    want = paged_attention_reference(q, k, v, 0, batch(ref), (rank + rope) ** -0.5)
    _close(got, want, 1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(kv.k[0], ref.k[0])


@inner
def test_interp_graph_padded_decode_on_the_latent_cache_equals_torch() -> None:
    """StepGraphs' padded decode batch over the latent cache: two real rows and a padding row (context 1,
    block 0, writing the pad slot); the real rows equal the torch path's, the pad slot aside."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache, KVShape, PagedAttentionMetadata
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

    g = torch.Generator().manual_seed(12)
    heads, rank, rope, pad_slot = 32, 512, 64, 47
    shape = KVShape(1, rank + rope, rank, v_in_k=True)
    kv = KVCache.allocate({0: shape}, 12, 4, torch.bfloat16)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    meta = PagedAttentionMetadata.decode(torch.tensor([[5, 2, 7], [3, 9, 0], [0, 0, 0]], dtype=torch.int32),
                                         torch.tensor([11, 6, 1], dtype=torch.int32))
    slots = torch.tensor([7 * 4 + 2, 9 * 4 + 1, pad_slot])
    q = torch.randn(3, heads, rank + rope, generator=g).to(torch.bfloat16)
    k = torch.randn(3, 1, rank + rope, generator=g).to(torch.bfloat16)

    def batch(cache: KVCache) -> ForwardBatch:
        zeros = torch.zeros(3, dtype=torch.long)
        return ForwardBatch(zeros, zeros, [1] * 3, [1] * 3, slots, [[0]] * 3, cache, paged=meta)

    ref = KVCache.allocate({0: shape}, 12, 4, torch.bfloat16)
    ref.k[0].copy_(kv.k[0])
    got = paged_decode_attention_triton(q, k, k[..., :rank], 0, batch(kv), 0.05)
    want = paged_attention_torch(q, k, k[..., :rank], 0, batch(ref), 0.05)
    _close(got[:2], want[:2], 1e-2)
    assert torch.equal(kv.k[0][:pad_slot], ref.k[0][:pad_slot])


@inner
@pytest.mark.parametrize("n,k,experts", [(1, 4, 6), (13, 3, 5), (40, 2, 3)])
def test_interp_fused_experts_equal_the_torch_blocks(n: int, k: int, experts: int) -> None:
    from fusedserve.models.layers.fused_moe import fused_experts_torch
    from fusedserve.models.layers.fused_moe_triton import fused_experts_triton

    g = torch.Generator().manual_seed(n)
    hidden, inter = 64, 32
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(torch.bfloat16)
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, experts, (n, k), generator=g)  # -1: another rank's expert
    w = torch.rand(n, k, generator=g)
    got = fused_experts_triton(x, ids, w, gate_up, down)
    want = fused_experts_torch(x.float(), ids, w, gate_up.float(), down.float())
    _close(got.float(), want, 2e-2)


@inner
@pytest.mark.parametrize("m,n,k,block,dtype", [(3, 200, 96, (32, 32), torch.float32),
                                               (20, 72, 160, (16, 32), torch.bfloat16),
                                               (1, 576, 256, (128, 128), torch.bfloat16),
                                               (2, 72, 1000, (128, 128), torch.float32),
                                               (70, 72, 96, (32, 32), torch.bfloat16)],
                         ids=["partial-blocks-fp32", "bn-ne-bk-bf16", "kv_a-shape-bf16", "split-k-fp32",
                              "rows-70-bf16"])
def test_interp_block_fp8_linear_equals_the_w8a8_reference(m: int, n: int, k: int, block: tuple[int, int],
                                                           dtype: torch.dtype) -> None:
    """Per-token-group quantization and the block-scaled GEMM (partial last blocks, bn != bk, DeepSeek's
    576-row kv_a_proj_with_mqa at 128x128, K split with the last program adding the partials, 70 rows) equal
    the torch w8a8 reference; that one is within the stated activation-quantization error of the dequantized
    reference."""
    from fusedserve.models.layers.fp8_block import (
        BlockFP8,
        block_fp8_linear_reference,
        block_fp8_linear_w8a8_reference,
        quantize_activation,
        quantize_weight,
    )
    from fusedserve.models.layers.fp8_block_triton import block_fp8_linear_triton, group_quant_triton

    g = torch.Generator().manual_seed(m)
    fmt = BlockFP8(*block)
    x = torch.randn(m, k, generator=g).to(dtype)
    w, s = quantize_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
    bias = torch.randn(n, generator=g).to(dtype)
    q, qs = group_quant_triton(x, fmt.block_k)
    rq, rs = quantize_activation(x, fmt.block_k)
    assert torch.equal(q.float(), rq.float()) and torch.equal(qs, rs)
    want = block_fp8_linear_w8a8_reference(x, w, s, bias, fmt)
    _close(block_fp8_linear_triton(x, w, s, bias, fmt), want, 1e-6)
    if k == 1000:  # 8 K blocks (the last partial) over one tile: split in 4
        from fusedserve.models.layers.fp8_block_triton import k_splits

        assert k_splits(tiles=2, k_blocks=8, sms=132) == 4
        # o_proj's 56 tiles of 128 columns over 128 K blocks: 2 splits at one program an SM, 9 at four
        assert k_splits(56, 128, 132, 16) == 2 and k_splits(56, 128, 132, 16, per_sm=4) == 9
    import fusedserve.models.layers.arrival_counters as arrival

    assert int(arrival._COUNTERS.get(torch.device("cpu"), torch.zeros(1)).abs().sum()) == 0
    _close(want, block_fp8_linear_reference(x, w, s, bias, fmt), 5e-2)  # e4m3 activations: ~3% on random data


@inner
@pytest.mark.parametrize("m,n,k,block,dtype", [(1, 200, 96, (32, 32), torch.bfloat16),
                                               (5, 72, 160, (16, 32), torch.float16),
                                               (16, 576, 256, (128, 128), torch.bfloat16),
                                               (2, 72, 1000, (128, 128), torch.bfloat16)],
                         ids=["partial-blocks", "bn-ne-bk-fp16", "kv_a-shape-16-rows", "split-k"])
def test_interp_block_fp8_w8a16_equals_the_dequantized_reference(m: int, n: int, k: int, block: tuple[int, int],
                                                                 dtype: torch.dtype) -> None:
    """The weight-only decode kernel (bf16 / fp16 activations as they are, e4m3 weights scaled per block after each
    K block's dot) equals the dequantized model's x @ W^T + b within the output's rounding: partial last blocks, bn !=
    bk, 16 rows, K split over the tile's programs with the last one adding the partials (counts back at 0); the fast
    set routes decode rows to it up to ``ROWS``, more rows and fp32 to the w8a8 GEMM."""
    from fusedserve.models.layers import fp8_block_gemm
    from fusedserve.models.layers import fp8_block_w8a16_triton as w8a16
    from fusedserve.models.layers.fp8_block import BlockFP8, block_fp8_linear_reference, quantize_weight

    g = torch.Generator().manual_seed(m + k)
    fmt = BlockFP8(*block)
    x = torch.randn(m, k, generator=g).to(dtype)
    w, s = quantize_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
    bias = torch.randn(n, generator=g).to(dtype)
    want = block_fp8_linear_reference(x.float(), w, s, bias.float(), fmt)
    got = w8a16.block_fp8_linear_w8a16_triton(x, w, s, bias, fmt)
    assert got.dtype == dtype
    _close(got.float(), want, 1e-2)
    if k == 1000:  # 8 K blocks over one tile of 64 outputs (2 tiles): split so each program has 2 blocks
        assert w8a16.w8a16_launch(72, 1000, 128, 132) == (64, 4, 2)
        assert w8a16.w8a16_launch(7168, 16384, 128, 132) == (64, 2, 64)  # o_proj: 112 tiles, 2 programs an SM
        import fusedserve.models.layers.arrival_counters as arrival

        assert int(arrival._COUNTERS[torch.device("cpu")].abs().sum()) == 0
    assert w8a16.ROWS == 0 and not w8a16.supported(x.float(), w, s, fmt) and not w8a16.supported(
        x[:1].expand(17, k).contiguous(), w, s, fmt)
    before, w8a16.ROWS = w8a16.ROWS, 16
    try:
        assert torch.equal(fp8_block_gemm.block_fp8_linear_fast(x, w, s, bias, fmt), got)
    finally:
        w8a16.ROWS = before


@inner
@pytest.mark.parametrize("n,k,block,dtype,bias", [(200, 96, (32, 32), torch.bfloat16, True),
                                                  (72, 160, (16, 32), torch.float16, False),
                                                  (64, 4096, (128, 128), torch.bfloat16, False),
                                                  (40, 1000, (8, 128), torch.bfloat16, True),
                                                  (64, 576, (8, 64), torch.bfloat16, False)],
                         ids=["partial-k-block", "bn-ne-bk-fp16", "four-steps", "masked-last-step", "draft-head"])
def test_interp_block_fp8_gemv_equals_the_dequantized_reference(n: int, k: int, block: tuple[int, int],
                                                                dtype: torch.dtype, bias: bool) -> None:
    """The one-row weight-only GEMV (e4m3 words of four in fp32 registers, the block scale applied to x's columns)
    equals the dequantized model's x @ W^T + b within the output's rounding: a partial last K block, bn != bk, four
    1024-column steps, a masked last step, an EAGLE3 draft head's 8 x 64 blocks (hidden 576); the fast set
    routes one row to it (``ROWS`` 1; 0: never), not two rows, not fp32, not a block of rows narrower than the
    kernel's."""
    from fusedserve.models.layers import fp8_block_gemm
    from fusedserve.models.layers import fp8_block_gemv_triton as gemv
    from fusedserve.models.layers.fp8_block import BlockFP8, block_fp8_linear_reference, quantize_weight

    g = torch.Generator().manual_seed(n + k)
    fmt = BlockFP8(*block)
    x = torch.randn(1, k, generator=g).to(dtype)
    w, s = quantize_weight(torch.randn(n, k, generator=g) * 0.05, fmt)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = block_fp8_linear_reference(x.float(), w, s, b.float() if b is not None else None, fmt)
    got = gemv.block_fp8_gemv_triton(x, w, s, b, fmt)
    assert got.dtype == dtype and got.shape == (1, n)
    _close(got.float(), want, 1e-2)
    assert gemv.block_k(k) == {96: 128, 160: 256, 4096: 1024, 1000: 256, 576: 256}[k]
    assert not gemv.supported(x.float(), w, s, b, fmt) and not gemv.supported(
        x.expand(2, k).contiguous(), w, s, b, fmt) and not gemv.supported(x, w, s, b, BlockFP8(4, 128))
    assert gemv.ROWS == 1 and torch.equal(fp8_block_gemm.block_fp8_linear_fast(x, w, s, b, fmt), got)
    before, gemv.ROWS = gemv.ROWS, 0
    try:  # off: the w8a8 path (activations quantized: another result)
        assert not torch.equal(fp8_block_gemm.block_fp8_linear_fast(x, w, s, b, fmt), got)
    finally:
        gemv.ROWS = before


def _fp8_experts_case(dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    """4 block-FP8 experts (32 x 32 blocks) and 5 tokens routed top-2, two slots on another rank (-1) and one token
    wholly there -> (x, ids, routing weights, gate_up, its scales, down, its scales, format)."""
    from fusedserve.models.layers.fp8_block import BlockFP8, quantize_weight

    g = torch.Generator().manual_seed(seed)
    experts, hidden, inter, n, k = 4, 64, 32, 5, 2
    fmt = BlockFP8(32, 32)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    gate_up, gate_up_s = quantize_weight(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1, fmt)
    down, down_s = quantize_weight(torch.randn(experts, hidden, inter, generator=g) * 0.1, fmt)
    ids = torch.tensor([[2, 0], [2, -1], [3, 1], [-1, -1], [0, 2]])  # -1: another rank's expert
    w = torch.rand(n, k, generator=g)
    return x, ids, w, gate_up, gate_up_s, down, down_s, fmt


@inner
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interp_fp8_fused_experts_equal_the_w8a8_reference(dtype: torch.dtype) -> None:
    from fusedserve.models.layers.fused_moe import fused_experts_fp8_torch, fused_experts_fp8_w8a8_reference
    from fusedserve.models.layers.fused_moe_fp8_triton import fused_experts_fp8_triton

    x, ids, w, gate_up, gate_up_s, down, down_s, fmt = _fp8_experts_case(dtype, 3)
    want = fused_experts_fp8_w8a8_reference(x, ids, w, gate_up, gate_up_s, down, down_s, fmt)
    got = fused_experts_fp8_triton(x, ids, w, gate_up, gate_up_s, down, down_s, fmt)
    _close(got, want, 1e-6)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    _close(want, fused_experts_fp8_torch(x, ids, w, gate_up, gate_up_s, down, down_s, fmt), 8e-2)


@inner
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_interp_fp8_fused_experts_w8a16_equal_the_dequantized_experts(dtype: torch.dtype) -> None:
    """Up to ``W8A16_ROWS`` tokens the FP8 experts take x and the SwiGLU output as they are (no quantization):
    within the output's rounding of the dequantized experts, closer than the w8a8 path; more tokens keep w8a8."""
    import fusedserve.models.layers.fused_moe_fp8_triton as moe8
    from fusedserve.models.layers.fused_moe import fused_experts_fp8_torch

    x, ids, w, gate_up, gate_up_s, down, down_s, fmt = _fp8_experts_case(dtype, 5)
    want = fused_experts_fp8_torch(x.float(), ids, w, gate_up, gate_up_s, down, down_s, fmt)
    assert moe8.W8A16_ROWS == 0
    w8a8 = moe8.fused_experts_fp8_triton(x, ids, w, gate_up, gate_up_s, down, down_s, fmt)
    before, moe8.W8A16_ROWS = moe8.W8A16_ROWS, 16
    try:
        got = moe8.fused_experts_fp8_triton(x, ids, w, gate_up, gate_up_s, down, down_s, fmt)
    finally:
        moe8.W8A16_ROWS = before
    assert got.dtype == dtype and torch.equal(got[3], torch.zeros_like(got[3]))
    err = float((got.float() - want).norm() / want.norm())
    assert err < 1e-2 and err < float((w8a8.float() - want).norm() / want.norm())


@inner
@pytest.mark.parametrize("k,steps", [(3, 4), (8, 7)])
def test_interp_tree_expand(k: int, steps: int) -> None:
    """The fused tree growth (``tree_start_triton``, then each step's ``tree_expand_triton``, which writes the next
    feed) feeds the same tokens, hidden inputs and mask rows and grows the same candidates, leaves and hidden inputs
    as the torch ops, ties included (log-probabilities rounded to a few values); the built trees equal."""
    from fusedserve.worker.spec_decode.device_tree import TreeGrowth, TreeKernels
    from fusedserve.worker.spec_decode.tree_expand_triton import tree_expand_triton, tree_start_triton

    g = torch.Generator().manual_seed(k)
    b, hidden = 3, 40

    first_tok = torch.randint(0, 999, (b, k), generator=g)
    first_lp = -torch.randint(0, 3, (b, k), generator=g).float()
    roots = torch.arange(b)
    root_hidden = torch.randn(b, hidden, generator=g)
    grown = [TreeGrowth(roots, first_tok, first_lp, root_hidden, steps),
             TreeGrowth(roots, first_tok, first_lp, root_hidden, steps, TreeKernels(tree_start_triton,
                                                                                    tree_expand_triton))]
    for j in range(1, steps):
        tops = torch.randint(0, 999, (b * k, k), generator=g)
        lps = -torch.randint(0, 4, (b * k, k), generator=g).float() * 0.5  # few values: ties everywhere
        out = torch.randn(b * k, hidden, generator=g)
        fed = [t.feed() for t in grown]
        for x, y in zip(*fed):
            assert torch.equal(x, y)
        for t in grown:
            t.expand(tops, lps, out)
        for name in ("leaves", "leaf_hidden"):
            assert torch.equal(getattr(grown[0], name), getattr(grown[1], name)), name
        written = k + j * k * k  # the fused start leaves the later steps' columns for their expands
        for name in ("tokens", "parents", "depths", "scores"):
            assert torch.equal(getattr(grown[0], name)[:, :written], getattr(grown[1], name)[:, :written]), name
    trees = [t.build(min(1 + k * 2, 1 + k + (steps - 1) * k * k)) for t in grown]
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), name


@inner
@pytest.mark.parametrize(("k", "steps", "nodes"), [(4, 6, 16), (2, 6, 10), (8, 7, 60), (3, 2, 13), (1, 5, 6)],
                         ids=["s6-k4-t16", "s6-k2-t10", "s7-k8-t60", "every-candidate", "chain-like"])
def test_interp_tree_build_equals_the_torch_build(k: int, steps: int, nodes: int) -> None:
    """The verified trees in one launch (``tree_build_triton``) equal ``TreeGrowth``'s torch build (tokens, parents,
    depths, ancestor masks) after a growth with ties everywhere (log-probabilities of a few values), for the served
    trees' shapes, 392 candidates (several column blocks of the rank count), a tree of every candidate, and k = 1."""
    from fusedserve.worker.spec_decode.device_tree import TreeGrowth, TreeKernels
    from fusedserve.worker.spec_decode.tree_build_triton import tree_build_triton
    from fusedserve.worker.spec_decode.tree_expand_triton import tree_expand_triton, tree_start_triton

    g = torch.Generator().manual_seed(k * 100 + nodes)
    b, hidden = 3, 8
    first_tok = torch.randint(0, 999, (b, k), generator=g)
    first_lp = -torch.randint(0, 3, (b, k), generator=g).float()
    roots = torch.randint(0, 999, (b,), generator=g)
    grown = [TreeGrowth(roots, first_tok, first_lp, torch.zeros(b, hidden), steps),
             TreeGrowth(roots, first_tok, first_lp, torch.zeros(b, hidden), steps,
                        TreeKernels(tree_start_triton, tree_expand_triton, tree_build_triton))]
    for _ in range(1, steps):
        tops = torch.randint(0, 999, (b * k, k), generator=g)
        lps = -torch.randint(0, 4, (b * k, k), generator=g).float() * 0.5
        for t in grown:
            t.feed()
            t.expand(tops, lps, torch.zeros(b * k, hidden))
    want, got = (t.build(nodes) for t in grown)
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    assert int(want.depths.max()) >= 2  # trees, not the root's children alone


@inner
@pytest.mark.parametrize("vocab,k", [(1000, 8), (32000, 4), (257, 1)])
def test_interp_topk_logprobs(vocab: int, k: int) -> None:
    """The draft's one-kernel top-k: torch's log-softmax top-k (values to fp32 rounding, the same indices;
    ties go to the lower index)."""
    from fusedserve.worker.spec_decode.topk_logprobs_triton import topk_logprobs_triton

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g) * 4
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1  # a tie at the top: index 7 first
    values, indices = topk_logprobs_triton(logits, k)
    table = torch.randperm(2 * vocab, generator=g)[:vocab]
    mapped_values, mapped = topk_logprobs_triton(logits, k, table)  # through a draft vocabulary's table
    assert torch.equal(mapped_values, values) and torch.equal(mapped, table[indices])
    want = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    assert torch.equal(indices[[0, 1, 2, 4]], want.indices[[0, 1, 2, 4]])
    assert indices[3, 0] == 7 and (k == 1 or indices[3, 1] == 11)
    torch.testing.assert_close(values, want.values, rtol=0, atol=2e-5)


ROUTER_CASES = {  # DeepSeek-V3 / Kimi-K2, a padded sigmoid grouping, DeepSeek-V2's two softmax methods, ungrouped
    "v3": (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5),
    "sigmoid-3-groups-k6": (24, 6, "sigmoid", "noaux_tc", 3, 2, True, 1.0),
    "v2-group-limited": (20, 3, "softmax", "group_limited_greedy", 4, 2, False, 1.0),
    "v2-greedy": (10, 2, "softmax", "greedy", 1, 1, True, 1.5),
    "sigmoid-one-group": (16, 4, "sigmoid", "noaux_tc", 1, 1, False, 1.0),
    # the shared expert folded into the routed ones (moe.py): one more slot, id num_experts, weight 1
    "v3-shared": (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, 1),
    "sigmoid-3-groups-k6-shared": (24, 6, "sigmoid", "noaux_tc", 3, 2, True, 1.0, 1),
}


@inner
@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_interp_router_choice_equals_select_experts(case: str) -> None:
    """One program per token chooses the experts ``select_experts`` chooses, with its weights (the order of a
    token's k experts is free in both)."""
    from fusedserve.models.layers.router import RouterConfig, select_experts
    from fusedserve.models.layers.router_triton import select_experts_triton

    cfg = RouterConfig(*ROUTER_CASES[case])
    g = torch.Generator().manual_seed(len(case))
    logits = torch.randn(9, cfg.num_experts, generator=g) * 2
    bias = torch.randn(cfg.num_experts, generator=g) * 0.3 if cfg.has_correction_bias else None
    want_w, want_ids = select_experts(logits, cfg, bias)
    got_w, got_ids = select_experts_triton(logits, cfg, bias)
    want_ids, want_at = want_ids.sort(-1)
    got_ids, got_at = got_ids.sort(-1)
    assert torch.equal(got_ids, want_ids) and got_ids.shape == (9, cfg.top_k + cfg.shared_experts)
    torch.testing.assert_close(got_w.gather(1, got_at), want_w.gather(1, want_at))
    if cfg.shared_experts:
        assert (got_ids[:, -1] == cfg.num_experts).all() and (got_w.gather(1, got_at)[:, -1] == 1).all()


@inner
@pytest.mark.parametrize("n,hidden,experts,dtype", [(1, 7168, 256, torch.bfloat16), (3, 7168, 256, torch.bfloat16),
                                                    (16, 600, 24, torch.float32), (5, 64, 7, torch.bfloat16),
                                                    (17, 64, 8, torch.bfloat16)])
def test_interp_router_logits_equal_the_fp32_product(n: int, hidden: int, experts: int, dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's logits in one launch: HF's fp32 product of the rows and the fp32 gate, but for the order of
    the sums (DeepSeek-V3's 256 x 7168 gate; a K that no step divides; experts that no program count divides;
    more rows than ``LOGITS_ROWS``: the reference itself)."""
    from fusedserve.models.layers import router_triton
    from fusedserve.models.layers.router import router_logits
    from fusedserve.models.layers.router_triton import router_logits_triton

    LOGITS_ROWS = 16
    monkeypatch.setattr(router_triton, "LOGITS_ROWS", LOGITS_ROWS)  # on, whatever the default
    g = torch.Generator().manual_seed(n * hidden + experts)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    weight = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    want = router_logits(x, weight)
    got = router_logits_triton(x, weight)
    assert got.dtype == torch.float32 and got.shape == (n, experts)
    if n > LOGITS_ROWS:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argsort(-1, descending=True)[:, :4], want.argsort(-1, descending=True)[:, :4])


@inner
@pytest.mark.parametrize("n,heads,nope,v,rank,block,dtype", [
    (1, 2, 128, 128, 512, (128, 128), torch.bfloat16),  # DeepSeek-V3's per-head shapes and blocks
    (3, 3, 32, 16, 96, (16, 32), torch.bfloat16),  # v rows a half block, the rank not a multiple of a step
    (16, 2, 24, 40, 64, (8, 16), torch.float32),  # widths no power of two: masked
    (17, 2, 32, 16, 64, (16, 32), torch.bfloat16)])  # more rows than ROWS: the reference itself
def test_interp_mla_absorb_from_fp8_equals_the_dequantized_products(n: int, heads: int, nope: int, v: int, rank: int,
                                                                    block: tuple[int, int], dtype: torch.dtype,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MLA's products with W_UK and W_UV read from kv_b's block-FP8 weight (e4m3 times its block's scale in fp32)
    equal the bmm with the dequantized halves, within the output's rounding, from strided rows as the layer
    passes them (q_nope a view of q)."""
    from fusedserve.models.layers import mla_absorb_triton as absorb
    from fusedserve.models.layers.fp8_block import BlockFP8, dequantize_weight, quantize_weight
    from fusedserve.models.layers.mla import KVBFP8, absorb_q, absorb_v

    monkeypatch.setattr(absorb, "ROWS", 16)  # on, whatever the default
    g = torch.Generator().manual_seed(n * heads + rank)
    fmt = BlockFP8(*block)
    w, s = quantize_weight(torch.randn(heads * (nope + v), rank, generator=g) * 0.05, fmt)
    fp8 = KVBFP8(w, s, fmt, nope, v)
    halves = dequantize_weight(w, s, fmt, torch.float32).view(heads, nope + v, rank)
    w_uk, w_uv = halves[:, :nope].contiguous(), halves[:, nope:].contiguous()
    q = torch.randn(n, heads, nope + 8, generator=g).to(dtype)
    q_nope = q[..., :nope]
    o = torch.randn(n, heads, rank, generator=g).to(dtype)
    want_q, want_v = absorb_q(q_nope.float(), w_uk), absorb_v(o.float(), w_uv)
    got_q, got_v = absorb.absorb_q_triton(q_nope, w_uk.to(dtype), fp8), absorb.absorb_v_triton(o, w_uv.to(dtype), fp8)
    assert got_q.shape == (n, heads, rank) and got_v.shape == (n, heads, v) and got_q.dtype == got_v.dtype == dtype
    _close(got_q, want_q.to(dtype), 1e-2)
    _close(got_v, want_v.to(dtype), 1e-2)


@inner
@pytest.mark.parametrize("n,k,experts,block_m", [(1, 8, 256, 16), (64, 8, 256, 16), (5, 3, 4, 2), (7, 2, 3, 4),
                                                 (40, 8, 32, 16), (256, 8, 256, 16)])
def test_interp_moe_align_in_one_launch_equals_moe_align(n: int, k: int, experts: int, block_m: int) -> None:
    """The same blocks as the torch grouping (``moe_blocks.same_blocks``; ids outside [0, experts): another
    rank's)."""
    from fusedserve.models.layers.fused_moe import moe_align
    from fusedserve.models.layers.moe_align_triton import moe_align_triton

    g = torch.Generator().manual_seed(n * k)
    ids = torch.randint(-1, experts + 2, (n, k), generator=g)
    from moe_blocks import same_blocks

    want, got = moe_align(ids, experts, block_m), moe_align_triton(ids, experts, block_m)
    assert (got.num_pairs, got.block_m) == (want.num_pairs, want.block_m)
    assert same_blocks(got, want)


@inner
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved-yarn", "rotate-half"])
def test_interp_mla_assemble_equals_the_reference(dtype: torch.dtype, interleave: bool) -> None:
    """MLA's query and key rows in one launch: the absorbed queries copied, RoPE (DeepSeek-V3's interleaved
    pairs with YaRN's attention factor, or rotate-half), the latent's RMSNorm — as ``mla_assemble`` computes
    them, from strided views (bf16: to the last bit but for cos / sin; the interpreter's are numpy's)."""
    from fusedserve.models.layers.mla import mla_assemble
    from fusedserve.models.layers.mla_assemble_triton import mla_assemble_triton
    from fusedserve.models.layers.mla_rotary import MLARotary
    from fusedserve.models.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(int(interleave))
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 4096}
    n, heads, rank, rope, nope = 5, 20, 64, 16, 8  # 20 heads: a partial second block of 16
    rotary = MLARotary(rope, 10000.0, yarn if interleave else None, 163840, interleave)
    norm = RMSNorm(rank, 1e-6, dtype)
    norm.weight.data = torch.randn(rank, generator=g).to(dtype)
    q = torch.randn(n, heads, nope + rope, generator=g).to(dtype)  # q_b_proj's output: [nope | rope] per head
    kv = torch.randn(n, rank + rope, generator=g).to(dtype)  # kv_a_proj_with_mqa's: [latent | rope]
    q_abs = torch.randn(heads, n, rank, generator=g).to(dtype).transpose(0, 1)  # as the bmm leaves it
    args = (q_abs, q[..., nope:], kv[:, :rank], kv[:, rank:], torch.tensor([0, 5, 100, 4097, 150000]), rotary, norm)
    (want_q, want_k), (got_q, got_k) = mla_assemble(*args), mla_assemble_triton(*args)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert torch.equal(got_q[..., :rank], want_q[..., :rank])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    _close(got_q[..., rank:], want_q[..., rank:], tol)
    _close(got_k, want_k, tol)


@inner
def test_interp_sampling_at_temperature_equals_the_reference() -> None:
    """Each row's token drawn at its temperature in two launches of a program per row and chunk (greedy rows,
    one with its max in two chunks, -inf logits, whole chunks of them, a vocabulary of nine chunks, the last
    partial, a table; the numbers and temperatures strided views, as a chain's column of numbers is): the
    reference's tokens for 40 numbers a row, its distributions to float32 rounding."""
    from fusedserve.worker.engine.sample_triton import sample_triton
    from fusedserve.worker.engine.sampler import sample_at_temperature

    g = torch.Generator().manual_seed(0)
    n, vocab = 5, 9000  # 9 chunks of 1024, the last partial
    logits = (3 * torch.randn(n, vocab, generator=g)).to(torch.bfloat16)
    logits[2, ::3] = float("-inf")
    logits[3, 5000:] = float("-inf")  # the last tokens impossible: the clamp's case at u near 1
    logits[0, 2100] = logits[0, 5100] = 40.0  # a greedy row's max in two chunks: the first index
    temps = torch.tensor([[0.0, 0.7, 1.0, 1.6, 0.0], [9.0] * 5]).t().contiguous()[:, 0]  # stride 2
    table = torch.randperm(vocab, generator=g) + 100
    for trial in range(40):
        u = torch.rand(n, 3, generator=g, dtype=torch.float64)[:, trial % 3]  # stride 3
        if trial == 0:
            u[3] = 1.0 - 1e-12
        want, want_q = sample_at_temperature(logits, temps, u, table, True)
        got, got_q = sample_triton(logits, temps, u, table, True)
        assert torch.equal(got, want), (trial, got, want)
        assert got_q is not None and want_q is not None
        _close(got_q, want_q, 1e-6)
    assert sample_triton(logits, temps, u)[1] is None


@inner
def test_interp_chain_rejection_rule_equals_the_reference() -> None:
    """The rejection rule for sampled chains from raw logits in one launch (a program a row, the last of a chain's
    rows to finish testing the chain): the reference's accepted counts, emitted tokens and rows of tokens after
    each root, over chains that accept all, none and some of their drafts; the arrival counts back at 0 after
    each launch."""
    import fusedserve.models.layers.arrival_counters as arrival
    from fusedserve.worker.spec_decode.chain_accept_triton import accept_chains_triton
    from fusedserve.worker.spec_decode.rejection_sampler import accept_chains_at_temperature

    g = torch.Generator().manual_seed(1)
    chains, k, vocab = 3, 4, 5000
    first = torch.tensor([0, 6, 11])  # rows of chain b: first[b] .. first[b] + k (a row between chains unused)
    counts = set()
    for trial in range(30):
        logits = (4 * torch.randn(17, vocab, generator=g)).to(torch.bfloat16)
        temps = torch.tensor([0.6, 1.0, 1.5])
        rows = first[:, None] + torch.arange(k + 1)
        p = torch.softmax(logits[rows].float() / temps[:, None, None], dim=-1)
        mix = 0.3 * (trial % 4)  # 0: the draft is the target (all accepted) .. 0.9: mostly noise
        q = (1 - mix) * p[:, :k] + mix * torch.softmax(3 * torch.randn(chains, k, vocab, generator=g), dim=-1)
        q = q / q.sum(-1, keepdim=True)
        drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(chains, k)
        u = torch.rand(chains, k + 1, generator=g, dtype=torch.float64)
        want = accept_chains_at_temperature(logits, first, temps, drafts, q, u)
        got = accept_chains_triton(logits, first, temps, drafts, q, u)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (trial, got, want)
        assert torch.equal(got[2], want[2]), (trial, got[2], want[2])  # each chain's tokens after its root
        assert int(arrival._COUNTERS[torch.device("cpu")].abs().sum()) == 0
        counts.update(want[0].tolist())
    assert {0, k} <= counts and len(counts) >= 4  # none, all and some accepted


@inner
def test_interp_chain_outcomes_equal_the_reference() -> None:
    """Every chain's outcome in one launch (``chain_outcomes_triton``): the reference's counts and tokens for
    greedy rows that accept all, some and none of their drafts, sampled rows among them (their count and token
    from the rejection rule), every row sampled, none; the targets a strided slice of a verdict."""
    from fusedserve.worker.spec_decode.chain_accept_triton import chain_outcomes_triton
    from fusedserve.worker.spec_decode.rejection_sampler import chain_outcomes

    g = torch.Generator().manual_seed(3)
    b, k = 5, 7
    verdict = torch.randint(0, 9, (b, 2 * (k + 1)), generator=g)
    targets = verdict[:, k:2 * k + 1]  # [b, k + 1], row stride 2(k + 1)
    drafts = torch.randint(0, 9, (b, k), generator=g)
    drafts[0] = targets[0, :k]  # all accepted
    drafts[1, :3] = targets[1, :3]  # three, then a miss
    drafts[1, 3] = targets[1, 3] + 1
    drafts[2, 0] = targets[2, 0] + 1  # none
    for pick in ([], [1, 3], [0, 1, 2, 3, 4], [4]):
        s = len(pick)
        count = torch.randint(0, k + 1, (s,), generator=g)
        token = torch.randint(100, 200, (s,), generator=g)
        p = torch.tensor(pick, dtype=torch.long) if pick else None
        want = chain_outcomes(drafts, targets, p, count if pick else None, token if pick else None)
        got = chain_outcomes_triton(drafts, targets, p, count if pick else None, token if pick else None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (pick, got, want)
        if not pick:
            assert want[0][:3].tolist() == [k, 3, 0]


@inner
def test_interp_restage_equals_the_reference() -> None:
    """The next verify's inputs moved to a sampled round's outcome and its drafts copied in, in one launch
    (``restage_triton``): the reference's (``restage_sampled``) ids, positions, slots through the block tables,
    causal index and context lengths, for the first sequences of a padded batch (the rest untouched)."""
    from dataclasses import replace

    from fusedserve.worker.executor.step_graphs import StaticInputs
    from fusedserve.worker.spec_decode.verify_program import restage_sampled
    from fusedserve.worker.spec_decode.verify_stage_triton import restage_triton

    g = torch.Generator().manual_seed(5)
    b, n, q, blocks, bs = 4, 3, 8, 6, 4
    rows = b * q
    index = (torch.arange(q) + torch.tensor([12, 9, 8, 5])[:, None]).reshape(-1)  # staged at least q - 1 on
    base = StaticInputs(torch.randint(0, 500, (rows,), generator=g), index + 1, torch.randint(0, 99, (rows,), generator=g),
                        index, index.view(b, q)[:, -1] + 1, torch.randperm(b * blocks, generator=g).view(b, blocks),
                        None, None, 999, bs)
    verdict = torch.randint(0, q, (b, 2 * q), generator=g)
    greedy = verdict[:, -1]  # a strided column
    counts = torch.tensor([q - 1, 0, 3])
    tokens = torch.randint(0, 50, (n, q), generator=g)
    drafts = torch.randint(0, 50, (n, q + 2), generator=g)  # wider than the verify's drafts
    got = []
    for fn in (restage_sampled, restage_triton):
        inputs = replace(base, **{name: getattr(base, name).clone() for name in
                                  ("ids", "positions", "slots", "index", "context_lens")})
        fn(inputs, counts, greedy[:n], tokens, drafts, n, q)
        got.append(inputs)
    for name in ("ids", "positions", "slots", "index", "context_lens"):
        assert torch.equal(getattr(got[0], name), getattr(got[1], name)), name
    assert torch.equal(got[1].ids.view(b, q)[n:], base.ids.view(b, q)[n:])
    assert torch.equal(got[1].ids.view(b, q)[:n, 1:], drafts[:, :q - 1])


@inner
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=["bf16", "fp32", "fp8"])
def test_interp_kv_move_equals_kv_cache_move(dtype: torch.dtype) -> None:
    """``move_kv_triton`` leaves a cache as ``KVCache.move`` does: groups of several layers (two head widths: two
    groups), an MLA-style layer whose V is K's first columns (K alone moves), a cache of separate tensors (no groups),
    and moves where one node's source is another's destination (every source read before any destination is
    written), a slot moved to itself and a row wider than one program's columns."""
    from fusedserve.models.forward_batch import KVCache, KVShape
    from fusedserve.worker.executor.kv_move_triton import move_kv_triton

    g = torch.Generator().manual_seed(3)
    shapes = {0: (2, 8), 1: (2, 8), 2: (1, 24), 3: KVShape(1, 24, 16, v_in_k=True), 4: (2, 8)}
    # slots 6, 8 and 9 are each one move's source and another's destination; slot 10 moves to itself
    src = torch.tensor([9, 12, 6, 17, 8, 10])
    dst = torch.tensor([5, 6, 7, 8, 9, 10])

    def filled(cache: KVCache) -> KVCache:
        for t in cache.stored():
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
        return cache

    def moved_bits(cache: KVCache) -> list[torch.Tensor]:  # KVCache.move on the raw bits (no fp8 index_copy_ on CPU)
        bits = [t.clone().view(torch.uint8) for t in cache.stored()]
        KVCache(k=dict(enumerate(bits)), v={}, block_size=4, num_blocks=8).move(src, dst)
        return bits

    grouped = filled(KVCache.allocate(shapes, 8, 4, dtype))
    assert len(grouped.groups) == 2
    k = {i: t.clone() for i, t in grouped.k.items()}
    separate = KVCache(k=k, v={i: k[i][..., :16] if i in grouped.v_in_k else t.clone() for i, t in grouped.v.items()},
                       block_size=4, num_blocks=8, v_in_k=grouped.v_in_k)
    assert len(separate.stored()) == len(grouped.stored()) == 9
    for cache in (grouped, separate):
        want = moved_bits(cache)
        move_kv_triton(cache, src, dst)
        assert all(torch.equal(t.view(torch.uint8), w) for t, w in zip(cache.stored(), want, strict=True))
    wide = filled(KVCache.allocate({0: (4, 1024)}, 8, 4, dtype))
    want = moved_bits(wide)
    move_kv_triton(wide, src, dst)
    assert all(torch.equal(t.view(torch.uint8), w) for t, w in zip(wide.stored(), want, strict=True))


@inner
def test_interp_tree_rounds_in_flight_with_the_fused_kernels_equal_the_torch_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny pair at tree-s5-k4-t16, greedy rounds in flight under (CPU) graphs, with what a GPU runs in place of
    the torch ops — the growth's fused start and steps (the feed from each expand), the one-launch build, the tree
    verify's stage kernel and the one-launch K/V move — gives the same tokens and acceptance as with the torch ops
    (the kernels run in Triton's interpreter)."""
    from pathlib import Path

    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.executor.kv_move_triton import move_kv_triton
    from fusedserve.worker.spec_decode import decoder, drafter
    from fusedserve.worker.spec_decode.config import SpeculativeConfig
    from fusedserve.worker.spec_decode.device_tree import TreeKernels
    from fusedserve.worker.spec_decode.tree_build_triton import tree_build_triton
    from fusedserve.worker.spec_decode.tree_expand_triton import tree_expand_triton, tree_start_triton
    from fusedserve.worker.spec_decode.tree_stage_triton import tree_stage_triton

    root = Path(__file__).resolve().parents[1] / "examples/checkpoints"
    prompts = ["def fib(n):\n    ", "import os\nclass Foo:\n"]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    calls: dict[str, int] = {}

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)
        return call

    def run(fused: bool) -> tuple[list[list[int]], int]:
        spec = SpeculativeConfig(str(root / "tiny-code-eagle3"), num_steps=5, topk=4, num_draft_tokens=16)
        engine = Engine(root / "tiny-code", EngineConfig(speculative=spec, num_blocks=64, block_size=4, max_num_seqs=2,
                                                         cuda_graph_batch_sizes=(1, 2), cuda_graphs=True))
        if fused:
            engine.executor.move_kv = counted("move", move_kv_triton)
        outs = engine.generate(prompts, greedy)
        return [list(c.token_ids) for c in outs], engine.stats().spec.accepted_tokens

    want = run(False)
    monkeypatch.setattr(drafter, "tree_kernels", lambda device: TreeKernels(
        counted("start", tree_start_triton), counted("expand", tree_expand_triton), counted("build", tree_build_triton)))
    monkeypatch.setattr(decoder, "tree_stage_kernel", lambda device: counted("stage", tree_stage_triton))
    assert run(True) == want and want[1] > 0
    assert all(calls.get(k, 0) > 2 for k in ("move", "start", "expand", "build", "stage")), calls
