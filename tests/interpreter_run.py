"""The Triton-interpreter run of tests/test_triton_interpret.py, started in the background.

Its ~50 interpreted kernel checks take 2.5-4 minutes of one core; CI has two and the rest of the suite keeps one
busy, so conftest starts this run as soon as the suite is collected (when the outer test is selected) and the
outer test only collects its result: the run overlaps the tests before it instead of adding to them. Its output
goes to a file, not a pipe (a pipe nobody reads until the end could fill and stall the run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TEST_FILE = Path(__file__).resolve().parent / "test_triton_interpret.py"
OUTER_TEST = "test_triton_interpret.py::test_kernels_under_the_triton_interpreter"
# From the run's start: ~2.5-3 min on 2 idle cores, 249 s seen on a busy CI machine (2026-12-04); twice that,
# under pytest's 600 s per test.
TIMEOUT_S = 540.0


@dataclass(frozen=True)
class InterpreterRun:
    proc: subprocess.Popen[bytes]
    log: Path
    started: float

    def result(self) -> tuple[int, str]:
        """(exit code, output), waiting until the run ends or ``TIMEOUT_S`` from its start (then killed)."""
        try:
            rc = self.proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()
            rc = -9
        out = self.log.read_text(errors="replace")
        self.log.unlink(missing_ok=True)
        return rc, out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


RUN = pytest.StashKey[InterpreterRun]()


def wanted() -> bool:
    """Whether this process should run the interpreter at all: not inside the run itself, and not where a GPU
    checks the real kernels (the outer test's own skip conditions)."""
    import torch

    return os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()


def start() -> InterpreterRun:
    fd, name = tempfile.mkstemp(prefix="triton-interpret-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TEST_FILE),
                                 "-k", "interp"], env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)
    return InterpreterRun(proc, Path(name), time.monotonic())
