"""The cyclic garbage collector while a process starts: off, then everything built so far is frozen.

Starting a rank actor or `fusedserve run` imports torch, transformers and Ray and builds the model:
millions of objects that live as long as the process. The collector walks all of them at every full
collection, again and again while they are being made: about a second of CPU per process start (a
quarter of a tiny rank's start on 2 cores), and nearly nothing to collect. ``paused()`` turns it off
for the start; on leaving, what exists is frozen (never walked again, which also keeps its pauses short
while serving, as vLLM and SGLang do after start-up) and collection resumes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def pause() -> None:
    gc.disable()


def resume() -> None:
    gc.freeze()
    gc.enable()


@contextmanager
def paused() -> Iterator[None]:
    pause()
    try:
        yield
    finally:
        resume()
