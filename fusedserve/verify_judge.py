"""How ``fusedserve verify`` judges logits: a tolerance that follows the oracle's own noise and the
logit scale, and agreement checks that forgive near-ties but not errors. Pure functions on tensors.

Two float implementations of one model never agree bit for bit: reductions run in another order
(an all-reduce over ranks, a fused kernel, another attention kernel). How far apart honest
implementations land is measured, not guessed: HF transformers' own eager and SDPA attention paths,
run on the same tokens, differ by ``noise`` (on SmolLM2-135M in fp32 about 5e-4 with logits up to
|40|; on a tiny random model about 1e-7). The tolerance is

    max(NOISE_FACTOR x noise, REL[dtype] x max |oracle logit|, FLOOR[dtype])

(a given ``--tolerance`` replaces it). A planted error — one skipped or doubled reduction — moves
logits by a sizeable fraction of their scale, orders of magnitude past it.

Beyond the largest difference, three checks a reader trusts more than one number, each allowing
only what a difference within tolerance can explain (a token whose oracle logit is within 2 x
tolerance of the oracle's best is an honest near-tie):

- argmax: at every position ours picks the oracle's argmax, or a near-tie of it;
- top-k: every token of our top-k is within 2 x tolerance of the oracle's k-th logit, and back;
- greedy continuation: each token we generate greedily is a greedy choice of the oracle fed the
  same prefix (teacher forcing), within 2 x tolerance; "exact" when it is the oracle's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOISE_FACTOR = 10.0
REL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}  # float16 keeps 3 more mantissa bits than bfloat16
FLOOR = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 1e-1}
TOP_K = 5


@dataclass(frozen=True)
class Tolerance:
    value: float
    given: bool  # --tolerance
    noise: float | None  # the oracle's own noise (None: not measured)
    noise_how: str
    scale: float  # max |oracle logit|
    rel: float
    floor: float

    def describe(self) -> str:
        if self.given:
            return f"{self.value:.2e} (given)"
        noise = (f"{NOISE_FACTOR:g} x oracle noise {self.noise:.2e} ({self.noise_how})" if self.noise is not None
                 else f"oracle noise not measured ({self.noise_how})")
        return (f"{self.value:.2e} = max({noise}, {self.rel:g} x max |logit| {self.scale:.3g}, "
                f"floor {self.floor:g})")


def calibrate(noise: float | None, noise_how: str, scale: float, dtype: str, given: float | None = None
              ) -> Tolerance:
    rel, floor = REL[dtype], FLOOR[dtype]
    if given is not None:
        return Tolerance(given, True, noise, noise_how, scale, rel, floor)
    value = max(NOISE_FACTOR * (noise or 0.0), rel * scale, floor)
    return Tolerance(value, False, noise, noise_how, scale, rel, floor)


@dataclass(frozen=True)
class Agreement:
    positions: int
    argmax_equal: int  # positions where our argmax is the oracle's
    near_ties: int  # positions where it is not, but within 2 x tolerance of the oracle's best
    argmax_ok: bool
    topk_violations: int  # positions whose top-k differ beyond a near-tie at the k-th place
    first_bad_position: int | None

    @property
    def topk_ok(self) -> bool:
        return self.topk_violations == 0


def agreement(ours: torch.Tensor, oracle: torch.Tensor, tol: float, k: int = TOP_K) -> Agreement:
    """ours, oracle: [positions, vocab] fp32."""
    slack = 2 * tol
    ours_arg, oracle_arg = ours.argmax(-1), oracle.argmax(-1)
    rows = torch.arange(ours.shape[0])
    gap = oracle.max(-1).values - oracle[rows, ours_arg]  # how much worse our pick is for the oracle
    equal = ours_arg == oracle_arg
    bad_arg = ~equal & (gap > slack)
    k = min(k, ours.shape[-1])
    bad_topk = _topk_outside(ours, oracle, k, slack) | _topk_outside(oracle, ours, k, slack)
    bad = bad_arg | bad_topk
    first = int(bad.nonzero()[0]) if bool(bad.any()) else None
    return Agreement(int(ours.shape[0]), int(equal.sum()), int((~equal & ~bad_arg).sum()), not bool(bad_arg.any()),
                     int(bad_topk.sum()), first)


def _topk_outside(a: torch.Tensor, b: torch.Tensor, k: int, slack: float) -> torch.Tensor:
    """Per position: a token of a's top-k whose logit under b is below b's k-th logit by more than slack."""
    idx = a.topk(k, dim=-1).indices
    kth = b.topk(k, dim=-1).values[:, -1:]
    return (b.gather(-1, idx) < kth - slack).any(-1)


@dataclass(frozen=True)
class Continuation:
    tokens: list[int]  # ours, greedy
    oracle_greedy: bool  # every token is a greedy choice of the oracle within 2 x tolerance
    exact: bool  # every token is the oracle's argmax
    first_divergence: int | None  # first token that is not the oracle's argmax


def continuation(oracle_rows: torch.Tensor, tokens: list[int], tol: float) -> Continuation:
    """oracle_rows: [len(tokens), vocab], row j = the oracle after the prompt and tokens[:j]."""
    rows = torch.arange(len(tokens))
    chosen = oracle_rows[rows, torch.tensor(tokens, dtype=torch.long)]
    best = oracle_rows.max(-1)
    exact = best.indices == torch.tensor(tokens, dtype=torch.long)
    first = int((~exact).nonzero()[0]) if not bool(exact.all()) else None
    return Continuation(list(tokens), bool((best.values - chosen <= 2 * tol).all()), bool(exact.all()), first)
