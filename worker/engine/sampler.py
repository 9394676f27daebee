"""Next tokens from logits: greedy, temperature, min-p, top-k, top-p, with a random stream per request.

The logits handed in are already adjusted (penalties, bias, ``min_tokens``, grammar:
``logits_processor.py``); ``min_p`` keeps the tokens whose probability after temperature is at
least ``min_p`` x the most likely token's.

Each row has its own parameters. A seeded request draws from its own ``torch.Generator``,
exactly one uniform number per sampled token, so its tokens depend on its seed and its own
logits only, never on which other requests share the batch. Unseeded rows draw from the
sampler's shared generator. Greedy rows draw nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import cast

import torch

from ..executor.gpu_kernel import gpu_kernel
from ..executor.host_copy import to_device
from .sequence import SamplingParams


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab]; temperatures: [n] (> 0) -> [n, vocab] float32"""
    return logits.float() / temperatures[:, None]


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where p(token) >= min_p x max p. logits: [n, vocab] (after temperature); min_p: [n] -> [n, vocab] bool"""
    probs = torch.softmax(logits, dim=-1)
    return probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a token survives top-k then top-p. logits: [n, vocab]; top_k: [n] int (vocab =
    keep all); top_p: [n] in (0, 1] -> [n, vocab] bool

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``
    (renormalised after top-k), and always the most likely token. Ties at the top-k boundary
    are broken by the sort order (lower token id first), so exactly k tokens survive.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    keep_sorted = rank < top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the better tokens
    keep_sorted &= mass_before < top_p[:, None]
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one uniform number per row. probs: [n, vocab]; uniforms: [n] in [0, 1) -> [n]"""
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (uniforms.double() * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    # Rounding at the top end must not land past the last token of non-zero probability.
    vocab = probs.shape[-1]
    last_positive = vocab - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(index, last_positive)


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


# (logits [n, vocab], temperatures [n] float32 (<= 0: the argmax), uniforms [n], table [vocab] int64 | None,
#  with_probs) -> (tokens [n] int64, through the table; the rows' distributions [n, vocab] float32 | None)
TemperatureSampleFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool],
                               "tuple[torch.Tensor, torch.Tensor | None]"]


def sample_at_temperature(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                          table: torch.Tensor | None = None, with_probs: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's token drawn at its temperature (``Sampler.probs`` of a request that sets nothing else: the
    softmax of logits / T, one-hot on the argmax where T <= 0) with its uniform number (``sample_from_probs``);
    graph-safe. The plain reference of ``sample_triton``. -> (tokens [n] int64, through ``table`` when given;
    the distributions [n, vocab] float32 when ``with_probs``)"""
    greedy = temperatures <= 0
    q = torch.softmax(apply_temperature(logits, torch.where(greedy, torch.ones_like(temperatures), temperatures)),
                      dim=-1)
    one_hot = torch.zeros_like(q).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    q = torch.where(greedy[:, None], one_hot, q)
    tokens = sample_from_probs(q, uniforms)
    return (tokens if table is None else table[tokens]), (q if with_probs else None)


def temperature_sampler(device: torch.device | str) -> TemperatureSampleFn:
    """``sample_triton`` where the hardware runs it (CUDA with Triton), else ``sample_at_temperature``; chosen once."""
    fast = gpu_kernel(device, f"{__package__}.sample_triton", "sample_triton")
    return cast(TemperatureSampleFn, fast or sample_at_temperature)


class Sampler:
    """``argmax``: the greedy choice's kernel ([n, vocab] -> [n] int64; the kernel set's, chosen at
    construction; default torch.argmax)."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu",
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 at_temperature: TemperatureSampleFn | None = None) -> None:
        self.device = torch.device(device)
        self.argmax = argmax or torch_argmax
        self.at_temperature = at_temperature or temperature_sampler(self.device)
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @staticmethod
    def request_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A request's own random stream (None for unseeded requests)."""
        if params.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(params.seed)
        return g

    def probs(self, logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from, after temperature, min-p, top-k and top-p.
        logits: [n, vocab] (adjusted) -> [n, vocab] float32; greedy rows are one-hot on the argmax."""
        logits = logits.float()
        vocab = logits.shape[-1]
        device = logits.device
        # The rows' parameters go to the device without waiting for it (``to_device``), and the
        # filters run only where a row asks for them (decided on the host, from the parameters).
        temps = to_device([p.temperature if not p.greedy else 1.0 for p in params], device, torch.float32)
        scaled = apply_temperature(logits, temps)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([float(p.min_p) for p in params], device, torch.float32)
            scaled = scaled.masked_fill(~min_p_mask(scaled, min_p), float("-inf"))
        top_k = [min(p.top_k_or_none or vocab, vocab) for p in params]
        if any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params):
            keep = top_k_top_p_mask(scaled, to_device(top_k, device),
                                    to_device([float(p.top_p) for p in params], device, torch.float32))
            scaled = scaled.masked_fill(~keep, float("-inf"))
        out = torch.softmax(scaled, dim=-1)
        if any(p.greedy for p in params):
            greedy = to_device([p.greedy for p in params], device, torch.bool)
            one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab).float()
            out = torch.where(greedy[:, None], one_hot, out)
        return out

    def __call__(self, logits: torch.Tensor, params: Seq[SamplingParams],
                 generators: Seq[torch.Generator | None]) -> list[int]:
        """One token per row. logits: [n, vocab]; params, generators: n each -> n token ids"""
        return [int(t) for t in self.draw(logits, params, generators).tolist()]

    def draw(self, logits: torch.Tensor, params: Seq[SamplingParams],
             generators: Seq[torch.Generator | None]) -> torch.Tensor:
        """``__call__`` left on the device (nothing read back): [n] int64 token ids. logits in any float
        dtype (the non-greedy path computes in float32)."""
        if logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} params / {len(generators)} generators")
        if not params:
            return torch.zeros(0, dtype=torch.long, device=logits.device)
        if all(p.greedy for p in params):
            return self.argmax(logits)
        # One uniform per random row from its own stream; greedy rows (one-hot) draw nothing.
        uniforms = torch.stack([torch.rand((), generator=g or self.generator, dtype=torch.float64, device=self.device)
                                if not p.greedy else torch.zeros((), dtype=torch.float64, device=self.device)
                                for p, g in zip(params, generators)]).to(logits.device)
        if all(p.greedy or p.temperature_only for p in params):  # the fast path (two launches on a GPU)
            temps = to_device([0.0 if p.greedy else p.temperature for p in params], logits.device, torch.float32)
            return self.at_temperature(logits, temps, uniforms, None, False)[0]
        return sample_from_probs(self.probs(logits, params), uniforms)
