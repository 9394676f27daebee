"""`make run` as a newcomer sees it: an embedded Ray, the tiny pair served, completions and metrics
printed, exit 0 (scripts/run-main.sh, which the Makefile's run target calls after set-up)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]


def test_make_run_serves_the_tiny_pair_prints_completions_and_exits() -> None:
    out = subprocess.run(["bash", "scripts/run-main.sh"], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=400)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr[-3000:]
    assert re.search(r"fusedserve: tiny-code ready in [\d.]+s: 1 engine group\(s\) x 1 rank\(s\)", text), text
    assert "OpenAI API: http://127.0.0.1:8000/v1" in text and "metrics: http://127.0.0.1:8000/metrics" in text
    assert "completion: 'def fibonacci(n):" in text and "chat:" in text
    assert re.search(r"acceptance length: [1-4]\.\d\d ", text), text
