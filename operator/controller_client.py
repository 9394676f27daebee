"""Reads a group controller's ``/status`` (JSON over HTTP), bounded in time and size.

A head pod is not trusted to answer well: the whole read (connect, headers, body) has a deadline and
the body a size limit, so a slow or huge answer costs the operator at most ``TIMEOUT_S`` and
``MAX_BYTES``. With the deployment's API key, the request carries ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 3.0
MAX_BYTES = 1 << 20  # a /status of 128 groups x 64 ranks is ~200 KiB
CHUNK = 64 * 1024


class ControllerUnreachable(RuntimeError):
    pass


def fetch_status(url: str, timeout: float = TIMEOUT_S, api_key: str | None = None,
                 max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            body = bytearray()
            while len(body) <= max_bytes:
                if time.monotonic() > deadline:
                    raise ControllerUnreachable(f"{url}: no complete answer within {timeout:.0f}s")
                chunk = resp.read1(CHUNK)
                if not chunk:
                    break
                body += chunk
            if len(body) > max_bytes:
                raise ControllerUnreachable(f"{url}: answer larger than {max_bytes} bytes")
        doc = json.loads(body.decode())
    except urllib.error.HTTPError as e:
        raise ControllerUnreachable(f"{url}: HTTP {e.code}") from e
    except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
        raise ControllerUnreachable(f"{url}: {getattr(e, 'reason', e)}") from e
    if not isinstance(doc, dict):
        raise ControllerUnreachable(f"{url}: not a JSON object")
    return doc
