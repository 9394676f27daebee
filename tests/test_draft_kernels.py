"""The EAGLE3 draft runs the target's kernel set: its input row (embedding and hidden state normed, side by
side), add + norm, RoPE, SiLU-and-mul and matmul (on a GPU the Triton kernels), with the same numbers as the
references.

A spy set delegates to the references and counts its calls; the draft built with it gives the reference
draft's logits and hidden states, and each of its ops ran.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusedserve.models.layers.draft_input import draft_input
from fusedserve.models.layers.kernels import Kernels
from fusedserve.models.layers.mlp import silu_and_mul
from fusedserve.models.layers.rotary import rope_reference
from fusedserve.models.loader import load_config
from fusedserve.models.parallel.fusion.reference import NormKernels, add_rms_norm, rms_norm
from fusedserve.worker.executor.step import SeqRows, Step
from fusedserve.worker.spec_decode.draft_model import build_draft

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "examples/checkpoints/tiny-code"
DRAFT = REPO / "examples/checkpoints/tiny-code-eagle3"


def spy_kernels(calls: Counter[str]) -> Kernels:
    def counted(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args)
        return run

    base = Kernels.reference()
    return replace(base, name="spy", norms=NormKernels(rms_norm=counted("rms_norm", rms_norm),
                                                         add_rms_norm=counted("add_rms_norm", add_rms_norm)),
                   rope=counted("rope", rope_reference), silu_and_mul=counted("silu_and_mul", silu_and_mul),
                   draft_input=counted("draft_input", draft_input), matmul=counted("matmul", F.linear))


def _two_steps(kernels: Kernels | None) -> tuple[torch.Tensor, ...]:
    config = load_config(str(TARGET))
    model, executor = build_draft(DRAFT, TARGET, config, 8, 16, torch.float32, torch.device("cpu"), kernels=kernels)
    gen = torch.Generator().manual_seed(0)
    seq = [3, 17, 99, 5, 250, 8, 61, 40, 12]
    n = len(seq) - 2
    aux = torch.randn(n, int(model.fc.in_features), generator=gen)
    first = executor.run(Step((SeqRows((0, 1), tuple(seq[1: n + 1]), tuple(range(1, n + 1)), n, n),)), aux)
    step = executor.run(Step((SeqRows((0, 1), (seq[n + 1],), (n + 1,), n + 1, 1),)), first.hidden[0][n - 1:])
    return first.logits, first.hidden[0], step.logits, step.hidden[0]


def test_draft_runs_the_kernel_sets_ops_with_the_reference_numbers() -> None:
    calls: Counter[str] = Counter()
    expect = _two_steps(None)
    got = _two_steps(spy_kernels(calls))
    for e, g in zip(expect, got):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    # per forward: the input row, two add + norms, one RoPE, one SiLU-and-mul, and matmuls: qkv, o, gate_up,
    # down and lm_head, with fc on the first (aux states in)
    assert calls == Counter(draft_input=2, add_rms_norm=4, rope=2, silu_and_mul=2, matmul=11), calls


def test_a_block_fp8_head_is_the_dequantized_head_and_leaves_the_hidden_states(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel set names a block-FP8 format for the draft's LM head and the device has FP8 (faked here: the
    reference set dequantizes, so the CPU runs the same numbers a GPU's FP8 GEMV sums in another order), the head is
    quantized at load and the checkpoint's freed: the logits are x @ dequantize(W)^T, near the checkpoint head's,
    the hidden states untouched. No format, or a head that does not split into whole blocks: left as it is."""
    import fusedserve.models.eagle3 as eagle3
    from fusedserve.models.layers.fp8_block import BlockFP8, dequantize_weight

    plain = _two_steps(None)
    fmt = BlockFP8(8, 64)
    monkeypatch.setattr(eagle3, "has_fp8", lambda device: True)
    fp8 = _two_steps(replace(Kernels.reference(), draft_head=fmt))
    for i in (1, 3):  # the hidden states: the head is not on their path
        torch.testing.assert_close(fp8[i], plain[i], atol=0, rtol=0)
    for i in (0, 2):  # the logits: e4m3 rounding of the head's weights, ~2-3 % of their size
        err = float((fp8[i] - plain[i]).norm() / plain[i].norm())
        assert 0 < err < 0.05, err
        assert float((fp8[i].argmax(-1) == plain[i].argmax(-1)).float().mean()) >= 0.7
    config = load_config(str(TARGET))
    model, _ = build_draft(DRAFT, TARGET, config, 8, 16, torch.float32, torch.device("cpu"),
                           kernels=replace(Kernels.reference(), draft_head=fmt))
    assert model.lm_head_fp8 is not None and model.lm_head_scale_inv is not None
    assert model.lm_head.weight.numel() == 0  # the checkpoint's head is freed
    out = torch.randn(3, model.lm_head_fp8.shape[1], generator=torch.Generator().manual_seed(1))
    want = F.linear(out, dequantize_weight(model.lm_head_fp8, model.lm_head_scale_inv, fmt))
    torch.testing.assert_close(model.head(out), want, atol=0, rtol=0)
    for kernels in (Kernels.reference(), replace(Kernels.reference(), draft_head=BlockFP8(8, 96))):
        model, _ = build_draft(DRAFT, TARGET, config, 8, 16, torch.float32, torch.device("cpu"), kernels=kernels)
        assert model.lm_head_fp8 is None and model.lm_head.weight.numel() > 0  # no format / 128 % 96: as it is


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_draft_on_the_triton_set_matches_the_references_on_gpu() -> None:
    """bf16 on the GPU: the Triton input row / norms / RoPE / SiLU-and-mul / matmuls against the torch references,
    same weights (the set's block-FP8 LM head apart: its own test below); the greedy choice through the
    draft-to-target table against torch's."""
    config = load_config(str(TARGET))
    dev = torch.device("cuda")
    outs = []
    for kernels in (None, replace(Kernels.triton(), draft_head=None)):
        model, executor = build_draft(DRAFT, TARGET, config, 8, 16, torch.bfloat16, dev, kernels=kernels)
        gen = torch.Generator(device=dev).manual_seed(0)
        seq = [3, 17, 99, 5, 250, 8, 61, 40, 12]
        n = len(seq) - 2
        aux = torch.randn(n, int(model.fc.in_features), generator=gen, device=dev, dtype=torch.bfloat16)
        first = executor.run(Step((SeqRows((0, 1), tuple(seq[1: n + 1]), tuple(range(1, n + 1)), n, n),)), aux)
        step = executor.run(Step((SeqRows((0, 1), (seq[n + 1],), (n + 1,), n + 1, 1),)), first.hidden[0][n - 1:])
        outs.append([first.logits.float(), step.logits.float(), step.hidden[0].float()])
    for e, g in zip(*outs):
        scale = float(e.abs().max())
        assert float((g - e).abs().max()) <= 2e-2 * scale, (float((g - e).abs().max()), scale)
    # the greedy choice through the draft-to-target table in one launch (a draft's vocabulary; a wider one)
    from fusedserve.models.layers.argmax_triton import ONE_PROGRAM, argmax_to_triton

    for vocab in (16384, ONE_PROGRAM + 100):
        logits = torch.randn(3, vocab, device=dev, dtype=torch.bfloat16)
        table = torch.randperm(vocab, device=dev) + 5
        assert torch.equal(argmax_to_triton(logits, table), table[logits.argmax(dim=-1)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")
def test_the_triton_sets_fp8_draft_head_equals_its_dequantized_head_on_gpu() -> None:
    """The fast set's draft head in block FP8 (``Kernels.draft_head``, 8 x 64 blocks): quantized at load, one row
    through the FP8 GEMV and four through the w8a8 GEMM, within bf16 rounding (one row) / the activations' e4m3 rounding
    (four rows) of x @ dequantize(W)^T; at SmolLM2's draft shape too."""
    from fusedserve.models.layers import fp8_block_gemv_triton as gemv
    from fusedserve.models.layers.fp8_block import BlockFP8, dequantize_weight, quantize_weight

    assert Kernels.triton().draft_head == gemv.draft_head()
    fmt = BlockFP8(8, 64)
    config = load_config(str(TARGET))
    dev = torch.device("cuda")
    model, _ = build_draft(DRAFT, TARGET, config, 8, 16, torch.bfloat16, dev,
                           kernels=replace(Kernels.triton(), draft_head=fmt))
    assert model.lm_head_fp8 is not None and model.lm_head_scale_inv is not None
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = [(model.head, model.lm_head_fp8, model.lm_head_scale_inv)]
    w, s = quantize_weight(torch.randn(16384, 576, device=dev, generator=gen) * 0.05, fmt)
    cases.append((lambda x: Kernels.triton().block_fp8_matmul(x, w, s, None, fmt), w, s))
    for head, q, scale in cases:
        full = dequantize_weight(q, scale, fmt)
        for rows, tol in ((1, 5e-3), (4, 5e-2)):
            x = torch.randn(rows, q.shape[1], device=dev, generator=gen).bfloat16()
            want = F.linear(x.float(), full)
            got = head(x).float()
            assert float((got - want).norm() / want.norm()) < tol, (tuple(q.shape), rows)
