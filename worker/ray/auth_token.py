"""Ray's token authentication, the one way every Ray of fusedserve is started with it (no ray import).

Ray (2.52 and later) checks a shared token on every GCS, raylet and dashboard call when
``RAY_AUTH_MODE=token``; each process reads the token from the file ``RAY_AUTH_TOKEN_PATH`` names
and passes both variables on to the processes it starts. fusedserve always hands the token over
that way, as a file:

- on Kubernetes the operator keeps one Secret per deployment and mounts it into the head and every
  worker (``operator/ray_auth.py``);
- ``fusedserve run``'s embedded Ray gets a fresh token of the run in a file only its user can
  read, removed when the run ends (``launcher.embedded_ray_auth``).

A client without the token, or with another, is refused by the GCS (``tests/test_ray_auth.py``).

    os.environ.update(token_env(str(write_token_file(directory, new_token()))))
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE = "auth_token"
TOKEN_BYTES = 32  # 64 hex characters


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def token_env(token_path: str) -> dict[str, str]:
    """The environment of a Ray process that authenticates with the token in ``token_path``."""
    return {MODE_ENV: "token", TOKEN_PATH_ENV: token_path}


def write_token_file(directory: Path, token: str) -> Path:
    """``directory/auth_token``, readable by its owner only (created with that mode: never readable by others)."""
    path = directory / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path
