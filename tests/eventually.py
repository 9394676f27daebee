"""Test helper: wait, bounded, for a condition of a system running beside the test (an operator, a fake API
server, Prometheus)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.kube.api_server import KubeAPIError

# What a check may raise while the system is still getting there: it is asked again until the timeout.
NOT_YET = (AssertionError, KeyError, RuntimeError, KubeAPIError, httpx.HTTPError)


def eventually(check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2) -> Any:
    """``check()``'s first truthy result within ``timeout`` seconds (asked every ``interval``); else an
    AssertionError naming the check and its last result or error (chained)."""
    deadline = time.monotonic() + timeout
    while True:
        error: BaseException | None = None
        try:
            last = check()
        except NOT_YET as e:
            last = error = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            name = getattr(check, "__name__", repr(check))
            raise AssertionError(f"not true within {timeout}s: {name}: last {last!r}") from error
        time.sleep(interval)
