"""`fusedserve verify`: run a checkpoint on N ranks and compare with an oracle.

Refuses a split the checkpoint cannot take before any rank starts (``models/split_check.py``).
Spawns the ranks (gloo on CPU, NCCL on GPUs), runs one prefill forward over a prompt batch and
``continuation`` greedy decode steps after it (through the paged KV cache), and checks

1. the logits of every prompt position and decode step against HF transformers (or our own tp=1
   run) fed the same tokens, within a tolerance calibrated on the oracle's own noise and the logit
   scale (``verify_judge.py``: HF eager vs SDPA attention on the same tokens), plus argmax and
   top-5 agreement and that our greedy continuation is a greedy path of the oracle;
2. on every rank and every forward, the collectives executed against the communication plan.

Exit 0 only when all hold; the report says what tolerance it used and why.

A block-FP8 checkpoint (DeepSeek-V3 / Kimi-K2 releases) runs as ``--quantization`` says (auto: FP8
weights where the GPU has FP8 GEMMs, else dequantized; fp8: FP8 weights, the dequantizing reference
GEMMs on CPU; none: dequantized at load). The ``hf`` oracle is transformers' own fine-grained FP8
support (it dequantizes on CPU; it needs every weight to be whole blocks); ``hf-dequantized``
writes the checkpoint dequantized (``models/dequantized_checkpoint.py``) and runs HF on that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .verify_judge import FLOOR, Agreement, Continuation, Tolerance, agreement, calibrate, continuation

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TOLERANCE = FLOOR  # the calibrated tolerance never goes below it
CONTINUATION = 8  # greedy tokens generated after each prompt
FUSION_MODES = ("off", "reference", "flashinfer")
ORACLES = ("hf", "hf-dequantized", "tp1")
QUANTIZATIONS = ("auto", "fp8", "none")
DP_PADDINGS = ("auto", "max_len", "sum_len")


class VerifyError(RuntimeError):
    """Verification could not run (bad input, unloadable checkpoint, a rank failed)."""


@dataclass(frozen=True)
class VerifyOptions:
    model: str
    tp: int = 1
    dp: int = 1
    ep: int = 1
    fusion: str = "off"
    oracle: str = "hf"
    dtype: str = "float32"
    prompts: tuple[tuple[int, ...], ...] | None = None
    tolerance: float | None = None
    dp_padding: str = "auto"
    continuation: int = CONTINUATION
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.fusion not in FUSION_MODES:
            raise VerifyError(f"--fusion must be one of {', '.join(FUSION_MODES)}, not {self.fusion!r}")
        if self.oracle not in ORACLES:
            raise VerifyError(f"--oracle must be one of {', '.join(ORACLES)}, not {self.oracle!r}")
        if self.dp_padding not in DP_PADDINGS:
            raise VerifyError(f"--dp-padding must be one of {', '.join(DP_PADDINGS)}, not {self.dp_padding!r}")
        if self.dtype not in DTYPES:
            raise VerifyError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise VerifyError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.continuation < 1:
            raise VerifyError(f"--continuation must be at least 1, got {self.continuation}")

    @property
    def atol(self) -> float:
        """The given tolerance, else the floor of the calibrated one (for a caller without an oracle noise)."""
        return self.tolerance if self.tolerance is not None else DEFAULT_TOLERANCE[self.dtype]


@dataclass
class PromptReport:
    length: int
    argmax: int
    top5: list[int]
    oracle_argmax: int
    oracle_top5: list[int]
    max_abs_diff: float
    continuation: list[int] = field(default_factory=list)  # our greedy tokens after the prompt
    continuation_exact: bool = True  # every one the oracle's argmax given the same prefix
    continuation_greedy_ok: bool = True  # every one a greedy choice of the oracle within 2 x tolerance
    continuation_max_abs_diff: float = 0.0  # over the decode steps


@dataclass
class VerifyReport:
    architecture: str
    tp: int
    dp: int
    ep: int
    fusion: str
    oracle: str
    dtype: str
    max_abs_diff: float
    tolerance: float
    logits_ok: bool
    collectives_ok: bool
    planned_per_forward: int
    executed_per_forward: list[int]
    tolerance_how: str = ""
    oracle_noise: float | None = None
    logit_scale: float = 0.0
    positions: int = 0
    argmax_equal: int = 0
    argmax_near_ties: int = 0
    argmax_ok: bool = True
    topk_violations: int = 0
    continuation_ok: bool = True
    decode_forwards_off_plan: int = 0  # decode forwards (any rank) whose collectives differ from their plan
    quantization: str = "none"
    per_site: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)
    prompts: list[PromptReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.logits_ok and self.collectives_ok and self.argmax_ok and self.topk_violations == 0
                and self.continuation_ok and self.decode_forwards_off_plan == 0)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=2)

    def to_text(self) -> str:
        lines = [
            (f"fusedserve verify: {self.architecture} tp={self.tp} dp={self.dp} ep={self.ep} "
             f"fusion={self.fusion} oracle={self.oracle} dtype={self.dtype}"),
            f"  quantization: {self.quantization}",
            f"  tolerance: {self.tolerance_how or f'{self.tolerance:.2e}'}",
            f"  logits: max |diff| {self.max_abs_diff:.3e} over {self.positions} positions (prompts and "
            f"decode steps), tolerance {self.tolerance:.2e}  " + ("OK" if self.logits_ok else "MISMATCH"),
            f"  argmax: equal at {self.argmax_equal}/{self.positions}, near-ties {self.argmax_near_ties}; "
            f"top-5 differing beyond a near-tie at {self.topk_violations}  "
            + ("OK" if self.argmax_ok and not self.topk_violations else "MISMATCH"),
            f"  greedy continuation: {sum(p.continuation_exact for p in self.prompts)}/{len(self.prompts)} "
            f"prompts exactly the oracle's, all a greedy path of it within tolerance: "
            + ("OK" if self.continuation_ok else "MISMATCH"),
            f"  collectives per forward: planned {self.planned_per_forward}, executed "
            f"{'/'.join(map(str, self.executed_per_forward))} (per rank, prefill); decode forwards off plan: "
            f"{self.decode_forwards_off_plan}  "
            + ("OK" if self.collectives_ok and not self.decode_forwards_off_plan else "MISMATCH"),
        ]
        for site, both in self.per_site.items():
            planned, executed = ", ".join(both["planned"]) or "-", ", ".join(both["executed"]) or "-"
            mark = "" if both["planned"] == both["executed"] else "   <-- differs"
            lines.append(f"    {site:<22} planned {planned:<38} executed {executed}{mark}")
        lines += [f"    ! {m}" for m in self.mismatches]
        if self.paths:
            lines.append("  paths: " + ", ".join(f"{k}={v}" for k, v in sorted(self.paths.items())))
        for i, p in enumerate(self.prompts):
            lines.append(
                f"  prompt {i} (len {p.length}): argmax {p.argmax} top5 {p.top5} | oracle argmax "
                f"{p.oracle_argmax} top5 {p.oracle_top5} | max |diff| {p.max_abs_diff:.2e} | continuation "
                f"{p.continuation} {'= oracle' if p.continuation_exact else 'near-tie' if p.continuation_greedy_ok else 'DIVERGES'}"
            )
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def default_prompts(vocab_size: int) -> list[list[int]]:
    """Several sequences of different lengths (1 to 40 tokens), fixed by a seed."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (1, 7, 19, 40)]


def _paddings() -> dict[str, Any]:
    from fusedserve.models.parallel.dp_geometry import Padding

    return {"auto": None, "max_len": Padding.MAX_LEN, "sum_len": Padding.SUM_LEN}


BLOCK_SIZE = 16


def _blocks_for(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def _prefill_step(prompts: list[list[int]], dp_num_tokens: tuple[int, ...] | None = None,
                  padding: Any = None, extra_tokens: int = 0) -> Any:
    """One prefill forward of fresh prompts in consecutive cache blocks (room for ``extra_tokens``
    more per prompt), logits for every row."""
    from fusedserve.worker.executor.step import SeqRows, Step

    return Step(tuple(SeqRows(table, tuple(p), tuple(range(len(p))), len(p), len(p), state_slot=slot)
                      for slot, (p, table) in enumerate(zip(prompts, _block_tables(prompts, extra_tokens)))),
                dp_num_tokens=dp_num_tokens, dp_padding=padding)


def _block_tables(prompts: list[list[int]], extra_tokens: int) -> list[tuple[int, ...]]:
    tables, block = [], 0
    for p in prompts:
        n = _blocks_for(len(p) + extra_tokens)
        tables.append(tuple(range(block, block + n)))
        block += n
    return tables


def _decode_step(prompts: list[list[int]], tokens: list[list[int]], extra_tokens: int,
                 dp_num_tokens: tuple[int, ...] | None, padding: Any) -> Any:
    """One decode forward: each prompt feeds its last generated token."""
    from fusedserve.worker.executor.step import SeqRows, Step

    seqs = []
    for slot, (p, t, table) in enumerate(zip(prompts, tokens, _block_tables(prompts, extra_tokens))):
        pos = len(p) + len(t) - 1
        seqs.append(SeqRows(table, (t[-1],), (pos,), pos + 1, 1, state_slot=slot))
    return Step(tuple(seqs), dp_num_tokens=dp_num_tokens, dp_padding=padding)


def _engine_config(opts: VerifyOptions, prompts: list[list[int]], device: torch.device,
                   extra_tokens: int = 0) -> Any:
    from fusedserve.worker.engine.config import EngineConfig

    blocks = max(sum(_blocks_for(len(p) + extra_tokens) for p in prompts), 1)
    seqs = max(len(prompts), 1)
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=blocks, max_num_seqs=seqs,
                        max_batch_tokens=max(seqs, sum(map(len, prompts))), dtype=opts.dtype, device=str(device),
                        cuda_graphs=False, skip_tokenizer=True, quantization=opts.quantization)


def _rank_main(rank: int, world: int, backend: str, opts: VerifyOptions,
               prompts: list[list[int]]) -> dict[str, Any]:
    """One rank: the prefill forward, then ``opts.continuation - 1`` greedy decode forwards (every rank
    of an attention group sees the same gathered logits, so all pick the same tokens)."""
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.worker.parallel.rank import build_rank

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    groups = build_groups(ParallelConfig(opts.tp, opts.dp, opts.ep), rank, backend)
    # Under DP attention each DP group serves its own prompts: prompt i goes to group i % dp.
    mine = prompts[groups.coords.dp_rank :: opts.dp]
    extra = opts.continuation
    # Cache blocks for every prompt, not only this DP group's: ranks agree on the smallest count.
    built = build_rank(opts.model, _engine_config(opts, prompts, device, extra), groups, backend, opts.fusion)
    dp = opts.dp > 1
    counts = tuple(sum(map(len, prompts[d :: opts.dp])) for d in range(opts.dp)) if dp else None
    padding = _paddings()[opts.dp_padding] if dp else None
    out = built.executor.run(_prefill_step(mine, counts, padding, extra))
    ledger = built.model.comm.ledger
    planned, executed = ledger.forward_plan(), [r.key for r in ledger.forward_records()]
    logits = out.logits.float()
    ends = torch.tensor([len(p) for p in mine], dtype=torch.long).cumsum(0) - 1
    tokens = [[int(t)] for t in logits[ends.to(logits.device)].argmax(-1).tolist()] if mine else []
    steps: list[torch.Tensor] = []
    off_plan = 0
    step_counts = tuple(len(prompts[d :: opts.dp]) for d in range(opts.dp)) if dp else None
    for _ in range(opts.continuation - 1):
        step_logits = built.executor.run(_decode_step(mine, tokens, extra, step_counts, padding)).logits.float()
        off_plan += [r.key for r in ledger.forward_records()] != ledger.forward_plan()
        steps.append(step_logits.cpu())
        for t, nxt in zip(tokens, step_logits.argmax(-1).tolist()):
            t.append(int(nxt))
    leader = groups.coords.attn_tp_rank == 0
    return {
        "dp_rank": groups.coords.dp_rank,
        "logits": logits.cpu() if leader else None,
        "steps": steps if leader else None,
        "tokens": tokens,
        "planned": planned,
        "executed": executed,
        "decode_off_plan": off_plan,
        "paths": dict(ledger.calls),
        "fusion": built.fusion.value,
        "quantization": built.quantization.describe(opts.dtype, built.kernels.kernels),
    }


def _hf_model(opts: VerifyOptions) -> Any:
    """HF transformers on the checkpoint; ``hf-dequantized``: on a copy written dequantized (removed once
    loaded)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="fusedserve-dequantized-") as tmp:
        path = opts.model
        if opts.oracle == "hf-dequantized":
            from fusedserve.models.dequantized_checkpoint import write_dequantized

            path = str(write_dequantized(opts.model, tmp))
        try:
            return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[opts.dtype]).eval()
        except (ValueError, RuntimeError) as e:  # e.g. transformers cannot dequantize partial FP8 blocks
            raise VerifyError(f"HF transformers cannot load {opts.model}: {e}"
                              + ("; try --oracle hf-dequantized" if opts.oracle == "hf" else "")) from e


def _hf_logits(hf: Any, seqs: list[list[int]]) -> torch.Tensor:
    """HF transformers' logits of every position of every sequence, one sequence at a time."""
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([s])).logits[0].float() for s in seqs])


def _oracle_logits(opts: VerifyOptions, prompts: list[list[int]], hf: Any = None) -> torch.Tensor:
    """The oracle's logits of every position of ``prompts`` (HF transformers, or our own tp=1 rank)."""
    if opts.oracle in ("hf", "hf-dequantized"):
        return _hf_logits(hf if hf is not None else _hf_model(opts), prompts)
    from fusedserve.worker.parallel.rank import build_rank

    cpu = torch.device("cpu")
    built = build_rank(opts.model, _engine_config(opts, prompts, cpu))
    return built.executor.run(_prefill_step(prompts)).logits.float()


def oracle_noise(hf: Any, seqs: list[list[int]]) -> tuple[float | None, str]:
    """How far HF transformers' own eager and SDPA attention land apart on ``seqs`` (max |diff|)."""
    try:
        hf.set_attn_implementation("sdpa")
        sdpa = _hf_logits(hf, seqs)
        hf.set_attn_implementation("eager")
        eager = _hf_logits(hf, seqs)
    except Exception as e:  # noqa: BLE001 (an architecture HF cannot run both ways: say so, go on)
        return None, f"HF eager vs sdpa could not run: {type(e).__name__}: {str(e)[:120]}"
    finally:
        with contextlib.suppress(Exception):  # leave the oracle on SDPA for whoever uses it next
            hf.set_attn_implementation("sdpa")
    return float((eager - sdpa).abs().max()), f"HF eager vs sdpa attention on the same {len(seqs)} sequences"


def _assemble_logits(results: list[dict[str, Any]], prompts: list[list[int]], dp: int) -> torch.Tensor:
    """Every prompt's logits, in prompt order, from the first rank of each DP group."""
    per_group = {r["dp_rank"]: r["logits"] for r in results if r["logits"] is not None}
    rows: list[torch.Tensor] = []
    offsets = [0] * dp
    for i, p in enumerate(prompts):
        d = i % dp
        rows.append(per_group[d][offsets[d] : offsets[d] + len(p)])
        offsets[d] += len(p)
    return torch.cat(rows)


def _label(key: tuple[str, str, str]) -> str:
    return f"{key[1]}({key[2]})"


def ranks_collectives(results: list[dict[str, Any]]
                      ) -> tuple[bool, dict[str, dict[str, list[str]]], list[str], dict[str, int]]:
    """Every rank's executed collectives against rank 0's plan (and every rank planning the same):
    (all match, per site, deviations, rank 0's calls by "op/group/path")."""
    planned = results[0]["planned"]
    ok, per_site, mismatches = compare_collectives(planned, [r["executed"] for r in results])
    ok = ok and all(r["planned"] == planned for r in results)
    paths = {f"{op}/{group}/{path}": n for (op, group, path), n in results[0]["paths"].items()}
    return ok, per_site, mismatches, paths


def compare_collectives(planned: list[tuple[str, str, str]], executed_by_rank: list[list[tuple[str, str, str]]]
                        ) -> tuple[bool, dict[str, dict[str, list[str]]], list[str]]:
    """Planned vs executed per site (rank 0's view) and every rank's deviations."""
    sites: dict[str, dict[str, list[str]]] = {}
    for key in planned:
        sites.setdefault(key[0], {"planned": [], "executed": []})["planned"].append(_label(key))
    for key in executed_by_rank[0]:
        sites.setdefault(key[0], {"planned": [], "executed": []})["executed"].append(_label(key))
    mismatches = [
        f"rank {r}: executed {len(ex)} collectives, planned {len(planned)}"
        + (f"; first difference at #{_first_diff(planned, ex)}" if ex != planned else "")
        for r, ex in enumerate(executed_by_rank)
        if ex != planned
    ]
    return not mismatches, sites, mismatches


def _first_diff(a: list[Any], b: list[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_verify(opts: VerifyOptions, rank_main: Any = None) -> VerifyReport:
    """``rank_main``: what each rank runs (default ``_rank_main``; a test may wrap it, e.g. to plant an
    error in the rank process)."""
    from .worker.parallel.local_ranks import RankFailed, run_on_ranks

    arch, prompts = prepare(opts)
    try:
        results = run_on_ranks(rank_main or _rank_main, opts.tp, opts, prompts)
    except RankFailed as e:
        raise VerifyError(f"a rank failed: {e}") from e
    return judge(opts, arch, prompts, results)


def prepare(opts: VerifyOptions) -> tuple[str, list[list[int]]]:
    """Check everything that can be checked before a rank starts; -> (architecture, prompts)."""
    from fusedserve.models.loader import (
        CheckpointError,
        architecture_of,
        checkpoint_quantization,
        load_config,
    )
    from fusedserve.models.parallel.groups import ParallelConfig, ParallelConfigError
    from fusedserve.models.quantization import QuantizationError, choose_quantization
    from fusedserve.models.registry import UnsupportedArchitecture, model_class
    from fusedserve.models.split_check import SplitError, check_split

    try:
        par = ParallelConfig(opts.tp, opts.dp, opts.ep)
        config = load_config(opts.model)
        arch = architecture_of(config)
        model_class(arch)
        capability = (8, 9) if torch.cuda.is_available() else None  # checked again on each rank's device
        quant = choose_quantization(opts.quantization, checkpoint_quantization(config), arch, capability)
        check_split(config, par, quant.fp8)  # before any rank starts
    except (CheckpointError, ParallelConfigError, UnsupportedArchitecture, SplitError, QuantizationError) as e:
        raise VerifyError(str(e)) from e
    prompts = [list(p) for p in opts.prompts] if opts.prompts else default_prompts(config.vocab_size)
    bad = [t for p in prompts for t in p if not 0 <= t < config.vocab_size]
    if bad or not prompts or any(not p for p in prompts):
        raise VerifyError(f"prompts must be non-empty lists of token ids in [0, {config.vocab_size})")
    return arch, prompts


def judge(opts: VerifyOptions, arch: str, prompts: list[list[int]], results: list[dict[str, Any]],
          hf: Any = None) -> VerifyReport:
    """The report on the ranks' ``_rank_main`` results. ``hf``: the oracle model already loaded (or None)."""
    ours, tokens = _assemble(results, prompts, opts.dp)
    # Teacher forcing: the oracle fed each prompt and our continuation but its last token.
    seqs = [p + t[:-1] for p, t in zip(prompts, tokens)]
    if hf is None and opts.oracle == "tp1":
        try:  # HF only measures the noise here
            hf = _hf_model(opts)
        except Exception as e:  # noqa: BLE001
            noise_how = f"HF transformers cannot load the model: {type(e).__name__}: {str(e)[:120]}"
    hf = hf if hf is not None or opts.oracle == "tp1" else _hf_model(opts)  # the oracle (SDPA attention)
    oracle = _oracle_logits(opts, seqs, hf)
    noise, noise_how = oracle_noise(hf, seqs) if hf is not None else (None, noise_how)
    tol = calibrate(noise, noise_how, float(oracle.abs().max()), opts.dtype, opts.tolerance)
    return _report(opts, arch, results, prompts, tokens, ours, oracle, tol)


def _assemble(results: list[dict[str, Any]], prompts: list[list[int]], dp: int
              ) -> tuple[torch.Tensor, list[list[int]]]:
    """Every prompt's rows in prompt order — its prefill rows, then its decode steps' — and its
    continuation tokens, from the first rank of each DP group."""
    per_group = {r["dp_rank"]: r for r in results if r["logits"] is not None}
    prefill = _assemble_logits(results, prompts, dp)
    rows, tokens, start = [], [], 0
    for i, p in enumerate(prompts):
        r, j = per_group[i % dp], i // dp
        rows += [prefill[start : start + len(p)]] + [s[j : j + 1] for s in r["steps"]]
        tokens.append(r["tokens"][j])
        start += len(p)
    return torch.cat(rows), tokens


def _report(opts: VerifyOptions, arch: str, results: list[dict[str, Any]], prompts: list[list[int]],
            tokens: list[list[int]], ours: torch.Tensor, oracle: torch.Tensor, tol: Tolerance) -> VerifyReport:
    diff = (ours - oracle).abs().max(-1).values  # per position
    max_diff = float(diff.max())
    agree: Agreement = agreement(ours, oracle, tol.value)
    planned = results[0]["planned"]
    coll_ok, per_site, mismatches, paths = ranks_collectives(results)
    report = VerifyReport(
        architecture=arch, tp=opts.tp, dp=opts.dp, ep=opts.ep, fusion=opts.fusion, oracle=opts.oracle,
        dtype=opts.dtype, max_abs_diff=max_diff, tolerance=tol.value, logits_ok=max_diff <= tol.value,
        collectives_ok=coll_ok, tolerance_how=tol.describe(), oracle_noise=tol.noise, logit_scale=tol.scale,
        positions=agree.positions, argmax_equal=agree.argmax_equal, argmax_near_ties=agree.near_ties,
        argmax_ok=agree.argmax_ok, topk_violations=agree.topk_violations,
        decode_forwards_off_plan=sum(r["decode_off_plan"] for r in results), planned_per_forward=len(planned),
        executed_per_forward=[len(r["executed"]) for r in results], per_site=per_site,
        mismatches=mismatches, paths=paths, quantization=results[0]["quantization"],
    )
    start = 0
    for p, t in zip(prompts, tokens):
        n = len(p) + len(t) - 1
        last = start + len(p) - 1
        cont: Continuation = continuation(oracle[last : start + n], t, tol.value)
        report.prompts.append(PromptReport(
            length=len(p), argmax=int(ours[last].argmax()), top5=ours[last].topk(5).indices.tolist(),
            oracle_argmax=int(oracle[last].argmax()), oracle_top5=oracle[last].topk(5).indices.tolist(),
            max_abs_diff=float(diff[start : last + 1].max()), continuation=cont.tokens,
            continuation_exact=cont.exact, continuation_greedy_ok=cont.oracle_greedy,
            continuation_max_abs_diff=float(diff[last + 1 : start + n].max()) if n > len(p) else 0.0,
        ))
        start += n
    report.continuation_ok = all(p.continuation_greedy_ok for p in report.prompts)
    return report


def load_prompts_file(path: str) -> tuple[tuple[int, ...], ...]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VerifyError(f"--prompts {path}: {e}") from e
    if not isinstance(data, list) or not all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                              for p in data):
        raise VerifyError(f"--prompts {path}: expected a JSON list of token-id lists")
    return tuple(tuple(p) for p in data)
