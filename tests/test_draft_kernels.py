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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_draft_on_the_triton_set_matches_the_references_on_gpu() -> None:
    """bf16 on the GPU: the Triton input row / norms / RoPE / SiLU-and-mul / matmuls against the torch references,
    same weights; the greedy choice through the draft-to-target table against torch's."""
    config = load_config(str(TARGET))
    dev = torch.device("cuda")
    outs = []
    for kernels in (None, Kernels.triton()):
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
