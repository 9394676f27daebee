"""The (prompt ids, response ids) pairs `fusedserve train-draft` regenerates, kept in a file
(``--save-pairs``, read back by ``--pairs``): regeneration in one device call, training in the next.

One ``torch.save`` of plain tensors and values, read back with ``weights_only=True``: every pair's
prompt ids end to end (``prompts``) and response ids (``responses``), in uint16 where the vocabulary
fits (int32 else), their lengths (``prompt_lens``, ``response_lens``, int32 [pairs]), and ``meta``: the
target's ``vocab_size`` and ``model_type`` (checked against the target that reads the file) and how the
pairs were made (regeneration options and statistics). 6 400 pairs of 200 + 300 tokens: 6.4 MB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .draft_trainer import TrainDraftError

FORMAT = "fusedserve-draft-pairs/1"

Pair = tuple[list[int], list[int]]


def _flat(seqs: list[list[int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids end to end, uint16 if the vocabulary fits else int32, lengths int32 [len(seqs)])"""
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    return ids.to(torch.uint16) if vocab_size <= 1 << 16 else ids, lens


def _split(ids: torch.Tensor, lens: torch.Tensor) -> list[list[int]]:
    flat, out, i = ids.to(torch.int32).tolist(), [], 0
    for n in lens.tolist():
        out.append(flat[i : i + n])
        i += n
    return out


def save_pairs(path: str | Path, pairs: list[Pair], vocab_size: int, model_type: str, meta: dict[str, Any]) -> int:
    """Write ``pairs`` of a target (``vocab_size``, ``model_type``) with ``meta`` (plain values) to
    ``path`` (through a temporary file: never half a file); -> the file's size in bytes."""
    prompts, prompt_lens = _flat([p for p, _ in pairs], vocab_size)
    responses, response_lens = _flat([r for _, r in pairs], vocab_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": FORMAT, "prompts": prompts, "prompt_lens": prompt_lens, "responses": responses,
                "response_lens": response_lens,
                "meta": {**meta, "vocab_size": vocab_size, "model_type": model_type, "pairs": len(pairs)}}, tmp)
    tmp.replace(path)
    return path.stat().st_size


def load_pairs(path: str | Path, vocab_size: int, model_type: str) -> tuple[list[Pair], dict[str, Any]]:
    """The pairs in ``path`` and its ``meta``; refused (``TrainDraftError``) if the file is missing or
    not a pairs file, or was made for a target of another vocabulary or model type."""
    if not Path(path).is_file():
        raise TrainDraftError(f"--pairs {path}: no such file")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises what its zip and unpickling layers raise
        raise TrainDraftError(f"--pairs {path}: not a readable pairs file ({type(e).__name__})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TrainDraftError(f"--pairs {path}: not a pairs file of format {FORMAT}")
    meta = data.get("meta", {})
    theirs = {"vocab size": meta.get("vocab_size"), "model type": meta.get("model_type")}
    ours = {"vocab size": vocab_size, "model type": model_type}
    wrong = [f"{k} {theirs[k]} (the target: {ours[k]})" for k in ours if theirs[k] != ours[k]]
    if wrong:
        raise TrainDraftError(f"--pairs {path}: pairs of another target: {', '.join(wrong)}")
    try:
        prompts, responses = _split(data["prompts"], data["prompt_lens"]), _split(data["responses"], data["response_lens"])
    except (KeyError, AttributeError, RuntimeError) as e:
        raise TrainDraftError(f"--pairs {path}: corrupt pairs file ({type(e).__name__}: {e})") from e
    ids = torch.cat([data["prompts"].to(torch.int32), data["responses"].to(torch.int32)])
    consistent = (len(prompts) == len(responses) == meta.get("pairs")
                  and sum(map(len, prompts)) == data["prompts"].numel()
                  and sum(map(len, responses)) == data["responses"].numel()
                  and (ids.numel() == 0 or 0 <= int(ids.min()) <= int(ids.max()) < vocab_size))
    if not consistent:
        raise TrainDraftError(f"--pairs {path}: corrupt pairs file (lengths or ids out of range)")
    return list(zip(prompts, responses)), meta
