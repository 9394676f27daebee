"""`fusedserve verify`: run a checkpoint on N ranks and compare with an oracle.

Spawns the ranks (gloo on CPU, NCCL on GPUs), runs one prefill forward over a prompt batch,
and checks (1) the logits against HF transformers or our own tp=1 run, and (2) on every rank,
the collectives executed against the communication plan. Exit 0 only when both hold.

A block-FP8 checkpoint (DeepSeek-V3 / Kimi-K2 releases) runs as ``--quantization`` says (auto: FP8
weights where the GPU has FP8 GEMMs, else dequantized; fp8: FP8 weights, the dequantizing reference
GEMMs on CPU; none: dequantized at load). The ``hf`` oracle is transformers' own fine-grained FP8
support (it dequantizes on CPU; it needs every weight to be whole blocks); ``hf-dequantized``
writes the checkpoint dequantized (``models/dequantized_checkpoint.py``) and runs HF on that.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-1, "float16": 2e-2}
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

    @property
    def atol(self) -> float:
        return self.tolerance if self.tolerance is not None else DEFAULT_TOLERANCE[self.dtype]


@dataclass
class PromptReport:
    length: int
    argmax: int
    top5: list[int]
    oracle_argmax: int
    oracle_top5: list[int]
    max_abs_diff: float


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
    per_site: dict[str, dict[str, list[str]]]
    mismatches: list[str]
    paths: dict[str, int]
    quantization: str = "none"
    prompts: list[PromptReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.logits_ok and self.collectives_ok

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=2)

    def to_text(self) -> str:
        lines = [
            f"fusedserve verify: {self.architecture} tp={self.tp} dp={self.dp} ep={self.ep} "
            f"fusion={self.fusion} oracle={self.oracle} dtype={self.dtype}",
            f"  quantization: {self.quantization}",
            f"  logits: max |diff| {self.max_abs_diff:.3e} (tolerance {self.tolerance:.1e})  "
            + ("OK" if self.logits_ok else "MISMATCH"),
            f"  collectives per forward: planned {self.planned_per_forward}, executed "
            f"{'/'.join(map(str, self.executed_per_forward))} (per rank)  "
            + ("OK" if self.collectives_ok else "MISMATCH"),
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
                f"{p.oracle_argmax} top5 {p.oracle_top5} | max |diff| {p.max_abs_diff:.2e}"
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


def _prefill_step(prompts: list[list[int]], dp_num_tokens: tuple[int, ...] | None = None,
                  padding: Any = None) -> Any:
    """One prefill forward of fresh prompts in consecutive cache blocks, logits for every row."""
    from fusedserve.worker.executor.step import SeqRows, Step

    seqs, block = [], 0
    for slot, p in enumerate(prompts):
        n = -(-len(p) // BLOCK_SIZE)
        seqs.append(SeqRows(tuple(range(block, block + n)), tuple(p), tuple(range(len(p))), len(p), len(p),
                            state_slot=slot))
        block += n
    return Step(tuple(seqs), dp_num_tokens=dp_num_tokens, dp_padding=padding)


def _engine_config(opts: VerifyOptions, prompts: list[list[int]], device: torch.device) -> Any:
    from fusedserve.worker.engine.config import EngineConfig

    blocks = max(sum(-(-len(p) // BLOCK_SIZE) for p in prompts), 1)
    seqs = max(len(prompts), 1)
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=blocks, max_num_seqs=seqs,
                        max_batch_tokens=max(seqs, sum(map(len, prompts))), dtype=opts.dtype, device=str(device),
                        cuda_graphs=False, skip_tokenizer=True, quantization=opts.quantization)


def _rank_main(rank: int, world: int, backend: str, opts: VerifyOptions,
               prompts: list[list[int]]) -> dict[str, Any]:
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.worker.parallel.rank import build_rank

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    groups = build_groups(ParallelConfig(opts.tp, opts.dp, opts.ep), rank, backend)
    # Under DP attention each DP group serves its own prompts: prompt i goes to group i % dp.
    mine = prompts[groups.coords.dp_rank :: opts.dp]
    # Every rank's cache sized for all prompts: build_rank keeps the smallest any rank of the group asks for
    # (block tables are shared), and the DP group with the longer prompts needs the most.
    built = build_rank(opts.model, _engine_config(opts, prompts, device), groups, backend, opts.fusion)
    counts = tuple(sum(map(len, prompts[d :: opts.dp])) for d in range(opts.dp)) if opts.dp > 1 else None
    out = built.executor.run(_prefill_step(mine, counts, _paddings()[opts.dp_padding] if opts.dp > 1 else None))
    ledger = built.model.comm.ledger
    return {
        "dp_rank": groups.coords.dp_rank,
        "logits": out.logits.float().cpu() if groups.coords.attn_tp_rank == 0 else None,
        "planned": ledger.forward_plan(),
        "executed": [r.key for r in ledger.forward_records()],
        "paths": dict(ledger.calls),
        "fusion": built.fusion.value,
        "quantization": built.quantization.describe(opts.dtype, built.kernels.kernels),
    }


def _oracle_logits(opts: VerifyOptions, prompts: list[list[int]]) -> torch.Tensor:
    dtype = DTYPES[opts.dtype]
    if opts.oracle in ("hf", "hf-dequantized"):
        import tempfile

        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory(prefix="fusedserve-dequantized-") as tmp:
            path = opts.model
            if opts.oracle == "hf-dequantized":
                from fusedserve.models.dequantized_checkpoint import write_dequantized

                path = str(write_dequantized(opts.model, tmp))
            try:
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            except (ValueError, RuntimeError) as e:  # e.g. transformers cannot dequantize partial FP8 blocks
                raise VerifyError(f"HF transformers cannot load {opts.model}: {e}"
                                  + ("; try --oracle hf-dequantized" if opts.oracle == "hf" else "")) from e
        hf.eval()
        with torch.no_grad():
            return torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])
    from fusedserve.worker.parallel.rank import build_rank

    cpu = torch.device("cpu")
    built = build_rank(opts.model, _engine_config(opts, prompts, cpu))
    return built.executor.run(_prefill_step(prompts)).logits.float()


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


def run_verify(opts: VerifyOptions) -> VerifyReport:
    from fusedserve.models.loader import (
        CheckpointError,
        architecture_of,
        checkpoint_quantization,
        load_config,
    )
    from fusedserve.models.parallel.groups import ParallelConfig, ParallelConfigError
    from fusedserve.models.quantization import QuantizationError, choose_quantization
    from fusedserve.models.registry import UnsupportedArchitecture, model_class

    from .worker.parallel.local_ranks import RankFailed, run_on_ranks

    try:
        ParallelConfig(opts.tp, opts.dp, opts.ep)
        config = load_config(opts.model)
        arch = architecture_of(config)
        model_class(arch)
        capability = (8, 9) if torch.cuda.is_available() else None  # checked again on each rank's device
        choose_quantization(opts.quantization, checkpoint_quantization(config), arch, capability)
    except (CheckpointError, ParallelConfigError, UnsupportedArchitecture, QuantizationError) as e:
        raise VerifyError(str(e)) from e
    prompts = [list(p) for p in opts.prompts] if opts.prompts else default_prompts(config.vocab_size)
    bad = [t for p in prompts for t in p if not 0 <= t < config.vocab_size]
    if bad or not prompts or any(not p for p in prompts):
        raise VerifyError(f"prompts must be non-empty lists of token ids in [0, {config.vocab_size})")
    try:
        results = run_on_ranks(_rank_main, opts.tp, opts, prompts)
    except RankFailed as e:
        raise VerifyError(f"a rank failed: {e}") from e
    ours = _assemble_logits(results, prompts, opts.dp)
    oracle = _oracle_logits(opts, prompts)
    diff = (ours - oracle).abs()
    max_diff = float(diff.max())
    planned = results[0]["planned"]
    coll_ok, per_site, mismatches, paths = ranks_collectives(results)
    report = VerifyReport(
        architecture=arch, tp=opts.tp, dp=opts.dp, ep=opts.ep, fusion=opts.fusion, oracle=opts.oracle,
        dtype=opts.dtype, max_abs_diff=max_diff, tolerance=opts.atol, logits_ok=max_diff <= opts.atol,
        collectives_ok=coll_ok, planned_per_forward=len(planned),
        executed_per_forward=[len(r["executed"]) for r in results], per_site=per_site,
        mismatches=mismatches, paths=paths, quantization=results[0]["quantization"],
    )
    start = 0
    for p in prompts:
        last = start + len(p) - 1
        report.prompts.append(PromptReport(
            length=len(p), argmax=int(ours[last].argmax()), top5=ours[last].topk(5).indices.tolist(),
            oracle_argmax=int(oracle[last].argmax()), oracle_top5=oracle[last].topk(5).indices.tolist(),
            max_abs_diff=float(diff[start : last + 1].max()),
        ))
        start += len(p)
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
