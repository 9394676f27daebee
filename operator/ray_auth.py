"""Ray's token authentication between a deployment's head and workers (pure).

The mechanism is the runtime's (``fusedserve.worker.ray.auth_token``: ``RAY_AUTH_MODE=token``, the token in
the file ``RAY_AUTH_TOKEN_PATH`` names), the one ``fusedserve run``'s embedded Ray uses too. Here the file
is a Secret: one per deployment with a random token (created once, never rewritten: rotating it would cut
the running cluster in two), mounted into the head and every worker; the group controller in the head
container inherits the environment, so its driver authenticates too. A client without the token is
refused by the GCS. Works with any KubeRay version (no ``authOptions`` needed).
"""

from __future__ import annotations

import base64
from typing import Any

from fusedserve.worker.ray import auth_token

from .naming import Owner

TOKEN_KEY = auth_token.TOKEN_FILE  # the Secret's key, so the mounted file has the runtime's name
TOKEN_DIR = "/var/run/secrets/fusedserve/ray"
TOKEN_VOLUME = "ray-token"


def desired_token_secret(owner: Owner, token: str) -> dict[str, Any]:
    """``token`` is chosen by the caller (``auth_token.new_token()``, an effect: handlers.py), only when the
    Secret does not exist."""
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
    return [{"name": k, "value": v} for k, v in auth_token.token_env(f"{TOKEN_DIR}/{TOKEN_KEY}").items()]
