"""Sampler: greedy, temperature, top-k, top-p on hand-made logits; seeded, batch-independent draws."""

from __future__ import annotations

import math

import pytest
import torch

from fusedserve.worker.engine.sampler import Sampler, top_k_top_p_mask
from fusedserve.worker.engine.sequence import InvalidSamplingParams, SamplingParams

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (token 1 is the most likely)
PROBS = torch.tensor([0.25, 0.5, 0.0625, 0.125, 0.0625])
LOGITS = PROBS.log()[None, :]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.allclose(actual, expected.to(actual.dtype), atol=1e-6), (actual, expected)


def mask(top_k: int, top_p: float, logits: torch.Tensor = LOGITS) -> list[bool]:
    return top_k_top_p_mask(logits, torch.tensor([top_k]), torch.tensor([top_p]))[0].tolist()


def test_top_k_keeps_the_k_most_likely() -> None:
    assert mask(1, 1.0) == [False, True, False, False, False]
    assert mask(2, 1.0) == [True, True, False, False, False]
    assert mask(3, 1.0) == [True, True, False, True, False]
    assert mask(5, 1.0) == [True] * 5


def test_top_k_ties_keep_exactly_k_lowest_ids_first() -> None:
    logits = torch.tensor([[1.0, 3.0, 1.0, 1.0]])
    assert mask(2, 1.0, logits) == [True, True, False, False]


def test_top_p_smallest_set_reaching_p() -> None:
    assert mask(5, 0.5) == [False, True, False, False, False]  # 0.5 alone reaches 0.5
    assert mask(5, 0.51) == [True, True, False, False, False]  # needs 0.5 + 0.25
    assert mask(5, 0.75) == [True, True, False, False, False]
    assert mask(5, 0.8) == [True, True, False, True, False]  # + 0.125 = 0.875
    assert mask(5, 0.01) == [False, True, False, False, False]  # the top token always survives
    assert mask(5, 1.0) == [True] * 5


def test_top_p_applies_to_the_renormalised_top_k() -> None:
    # After top-k=2 the survivors have 2/3 and 1/3: top_p 0.6 keeps only the first.
    assert mask(2, 0.6) == [False, True, False, False, False]
    assert mask(2, 0.7) == [True, True, False, False, False]


def test_probs_with_temperature_top_k_top_p() -> None:
    sampler = Sampler(seed=0)
    p = sampler.probs(LOGITS, [SamplingParams(temperature=1.0)])[0]
    assert_close(p, PROBS)
    p = sampler.probs(LOGITS, [SamplingParams(temperature=0.5)])[0]
    sq = PROBS ** 2
    assert_close(p, sq / sq.sum())
    p = sampler.probs(LOGITS, [SamplingParams(top_k=2)])[0]
    assert_close(p, torch.tensor([1 / 3, 2 / 3, 0, 0, 0]))
    p = sampler.probs(LOGITS, [SamplingParams(top_p=0.8)])[0]
    assert_close(p, torch.tensor([0.25, 0.5, 0, 0.125, 0]) / 0.875)
    p = sampler.probs(LOGITS, [SamplingParams(temperature=0)])[0]
    assert p.tolist() == [0, 1, 0, 0, 0]


def test_greedy_is_argmax_and_mixed_rows() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(seed=0)
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [greedy] * 6, [None] * 6) == logits.argmax(-1).tolist()
    top1 = SamplingParams(temperature=0.7, top_k=1)
    mixed = [greedy, top1] * 3
    assert sampler(logits, mixed, [None] * 6) == logits.argmax(-1).tolist()


def test_sample_frequencies_follow_the_distribution() -> None:
    sampler = Sampler(seed=0)
    n = 4000
    params = [SamplingParams(top_p=0.8)] * n
    tokens = sampler(LOGITS.expand(n, -1), params, [None] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    expected = torch.tensor([0.25, 0.5, 0, 0.125, 0]) / 0.875
    assert counts[2] == 0 and counts[4] == 0
    for c, e in zip(counts.tolist(), expected.tolist()):
        assert abs(c - e) < 4 * math.sqrt(e * (1 - e) / n) + 1e-9


def test_seeded_rows_do_not_depend_on_batch_composition() -> None:
    vocab = 64
    rows = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch: list[tuple[torch.Tensor, SamplingParams]], steps: int) -> list[int]:
        """Sample ``steps`` times; returns the seeded request's (row 0's) tokens."""
        sampler = Sampler(seed=None)
        gens = [Sampler.request_generator(p) for _, p in batch]
        logits = torch.stack([r for r, _ in batch])
        return [sampler(logits, [p for _, p in batch], gens)[0] for _ in range(steps)]

    alone = draw([(rows[0], seeded)], 20)
    crowded = draw([(rows[0], seeded), (rows[1], SamplingParams()), (rows[2], SamplingParams(seed=7)),
                    (rows[3], SamplingParams(temperature=0)), (rows[4], SamplingParams(top_k=3))], 20)
    assert alone == crowded
    assert alone == draw([(rows[0], seeded)], 20)  # reproducible
    assert len(set(alone)) > 1  # and actually random
    other_seed = draw([(rows[0], SamplingParams(seed=99))], 20)
    assert other_seed != alone


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 4), [SamplingParams()], [None])


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1},
    {"max_tokens": 0}, {"stop": ("",)}, {"stop_token_ids": (-3,)},
])
def test_invalid_sampling_params(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_sampling_params_normalise_stop_lists() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert SamplingParams(top_k=-1).top_k_or_none is None and SamplingParams(top_k=5).top_k_or_none == 5


def test_the_fast_paths_are_the_references_off_cuda_and_where_triton_is_missing() -> None:
    """Every sampling and acceptance chooser gives its torch reference on CPU; ``gpu_kernel`` gives a kernel's
    wrapper only on CUDA and only where its module imports."""
    from fusedserve.worker.engine.sampler import sample_at_temperature, temperature_sampler
    from fusedserve.worker.executor.gpu_kernel import gpu_kernel
    from fusedserve.worker.spec_decode import rejection_sampler as rs
    from fusedserve.worker.spec_decode import verify_program as vp

    cpu = torch.device("cpu")
    assert temperature_sampler(cpu) is sample_at_temperature
    assert rs.chain_acceptor(cpu) is rs.accept_chains_at_temperature
    assert rs.chain_outcomes_fn(cpu) is rs.chain_outcomes
    assert vp.restage_fn(cpu) is vp.restage_sampled and vp.verify_stage_kernel(cpu) is None
    assert gpu_kernel("cpu", "math", "sqrt") is None
    assert gpu_kernel("cuda", "math", "sqrt") is math.sqrt  # (a CUDA device named; nothing runs on it)
    assert gpu_kernel("cuda", "fusedserve.no_such_kernels", "kernel") is None
