"""Acceptance length over a prompt set, with the spread a reader needs to judge a difference.

Per prompt: the engine's counters before and after it (drafts, accepted tokens). Over the set: the
acceptance length as vLLM and Prometheus define it (1 + accepted / drafts, pooled), the per-prompt
mean, standard deviation and quartiles, and a bootstrap 95 % interval of the pooled value
(resampling prompts). ``paired`` compares two runs on the same prompts: the per-prompt differences'
mean, standard deviation, a bootstrap interval of the pooled difference, and how many prompts went
each way.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

Counts = tuple[int, int]  # (drafts, accepted tokens) of one prompt


def pooled(rows: list[Counts]) -> float:
    drafts = sum(d for d, _ in rows)
    return 1 + sum(a for _, a in rows) / drafts if drafts else float("nan")


def per_prompt(rows: list[Counts]) -> list[float]:
    return [1 + a / d for d, a in rows if d]


def _bootstrap(fn: Any, n: int, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    values = sorted(fn([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def summary(rows: list[Counts]) -> dict[str, Any]:
    each = per_prompt(rows)
    out: dict[str, Any] = {"prompts": len(rows), "drafts": sum(d for d, _ in rows),
                           "accepted_tokens": sum(a for _, a in rows), "acceptance_length": round(pooled(rows), 4)}
    if len(each) >= 2:
        q = statistics.quantiles(each, n=4)
        lo, hi = _bootstrap(lambda idx: pooled([rows[i] for i in idx]), len(rows))
        out.update(per_prompt_mean=round(statistics.mean(each), 4), per_prompt_std=round(statistics.stdev(each), 4),
                   per_prompt_quartiles=[round(x, 4) for x in q], bootstrap_95=[round(lo, 4), round(hi, 4)])
    return out


def paired(a: list[Counts], b: list[Counts]) -> dict[str, Any]:
    """b relative to a, prompt by prompt (the same prompts in the same order)."""
    if len(a) != len(b):
        raise ValueError("paired runs need the same prompts")
    diffs = [y - x for x, y in zip(per_prompt(a), per_prompt(b))]
    out: dict[str, Any] = {"prompts": len(diffs), "pooled_difference": round(pooled(b) - pooled(a), 4),
                           "relative": round(pooled(b) / pooled(a) - 1, 4) if pooled(a) else None,
                           "prompts_higher": sum(d > 0 for d in diffs), "prompts_lower": sum(d < 0 for d in diffs),
                           "prompts_equal": sum(d == 0 for d in diffs)}
    if len(diffs) >= 2:
        lo, hi = _bootstrap(lambda idx: pooled([b[i] for i in idx]) - pooled([a[i] for i in idx]), len(diffs))
        out.update(per_prompt_mean_difference=round(statistics.mean(diffs), 4),
                   per_prompt_std_difference=round(statistics.stdev(diffs), 4), bootstrap_95=[round(lo, 4), round(hi, 4)])
    return out
