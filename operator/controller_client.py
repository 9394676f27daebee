"""Reads a group controller's ``/status`` (JSON over HTTP, a short timeout)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 3.0


class ControllerUnreachable(RuntimeError):
    pass


def fetch_status(url: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            doc = json.loads(resp.read().decode())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ControllerUnreachable(f"{url}: {getattr(e, 'reason', e)}") from e
    if not isinstance(doc, dict):
        raise ControllerUnreachable(f"{url}: not a JSON object")
    return doc
