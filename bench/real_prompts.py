"""MT-bench and HumanEval prompts for the real-model benchmarks (files from bench/real_data.py).

    mtbench(data_dir, n)    -> [(question_id, category, [turn 1, turn 2])]  (MT-bench's 80 questions)
    humaneval(data_dir, n)  -> [(task_id, prompt)]                          (HumanEval's 164 problems)

Each is asked as a chat user message in the target's template (HumanEval's prompt as the message, as
EAGLE's and SpecForge's benchmarks do). ``n`` takes the first n in file order (a fixed subset).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".whl/real/data"


def _need(path: Path) -> Path:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `python bench/real_data.py` (it packs the data into .whl/real/)")
    return path


def mtbench(data_dir: str | Path = DEFAULT_DIR, n: int | None = None) -> list[tuple[int, str, list[str]]]:
    rows = [json.loads(line) for line in _need(Path(data_dir) / "mt_bench.jsonl").read_text().splitlines() if line]
    return [(int(r["question_id"]), str(r["category"]), list(r["turns"])) for r in rows][:n]


def humaneval(data_dir: str | Path = DEFAULT_DIR, n: int | None = None) -> list[tuple[str, str]]:
    with gzip.open(_need(Path(data_dir) / "HumanEval.jsonl.gz"), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(str(r["task_id"]), str(r["prompt"])) for r in rows][:n]
