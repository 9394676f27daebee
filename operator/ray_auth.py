"""Ray's token authentication between a deployment's head and workers (pure).

Ray (2.52 and later) checks a shared token on every GCS, raylet and dashboard call when
``RAY_AUTH_MODE=token``; each process reads the token from ``RAY_AUTH_TOKEN_PATH``. The operator makes
one Secret per deployment with a random token (created once, never rewritten: rotating it would cut the
running cluster in two) and mounts it into the head and every worker; the group controller in the head
container inherits the environment, so its driver authenticates too. A client without the token is
refused by the GCS. Works with any KubeRay version (no ``authOptions`` needed).
"""

from __future__ import annotations

import base64
from typing import Any

from .naming import Owner

TOKEN_KEY = "auth_token"
TOKEN_DIR = "/var/run/secrets/fusedserve/ray"
TOKEN_VOLUME = "ray-token"
TOKEN_BYTES = 32  # secrets.token_hex(TOKEN_BYTES): 64 hex characters


def desired_token_secret(owner: Owner, token: str) -> dict[str, Any]:
    """``token`` is chosen by the caller (an effect: handlers.py), only when the Secret does not exist."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": owner.metadata(owner.ray_token_secret, "ray-auth"),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def token_volume(owner: Owner) -> dict[str, Any]:
    return {"name": TOKEN_VOLUME, "secret": {"secretName": owner.ray_token_secret, "defaultMode": 0o440}}


def token_mount() -> dict[str, Any]:
    return {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}


def token_env() -> list[dict[str, Any]]:
    return [{"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN_PATH", "value": f"{TOKEN_DIR}/{TOKEN_KEY}"}]
