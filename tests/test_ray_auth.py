"""Ray's token authentication as the operator configures it (ray_auth.py): a real Ray head started with the
head container's environment and the token Secret's value admits a client that has the token and refuses
one without it, or with another. Runs in the suite's private network namespace (TESTING.md)."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusedserve.operator.children import Context, desired_children, parse_spec
from fusedserve.operator.naming import Owner
from fusedserve.operator.ray_auth import TOKEN_DIR, TOKEN_KEY, desired_token_secret
from tests.serve_process import free_port

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
PROBE = """
import sys
from ray._raylet import GcsClient
try:
    print("ok", GcsClient(address=sys.argv[1]).internal_kv_get(b"session_name", b"session", timeout=5))
except Exception as e:
    print("refused", type(e).__name__, str(e).splitlines()[0][:200])
"""


def _pod_env(tmp_path: Path) -> dict[str, str]:
    """The head container's Ray environment, its token file mounted from the Secret into ``tmp_path``."""
    body = yaml.safe_load((REPO / "examples" / "01-tiny-code.yaml").read_text())
    owner = Owner.of(body)
    head = desired_children(owner, parse_spec(body), Context()).ray_cluster["spec"]["headGroupSpec"]
    env = {e["name"]: e["value"] for e in head["template"]["spec"]["containers"][0]["env"] if "value" in e}
    secret = desired_token_secret(owner, os.urandom(32).hex())
    mount = tmp_path / "ray-token"
    mount.mkdir()
    (mount / TOKEN_KEY).write_bytes(base64.b64decode(secret["data"][TOKEN_KEY]))
    assert env["RAY_AUTH_TOKEN_PATH"] == f"{TOKEN_DIR}/{TOKEN_KEY}"
    env["RAY_AUTH_TOKEN_PATH"] = str(mount / TOKEN_KEY)
    return env


def _probe(address: str, env: dict[str, Any]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, address], check=False, capture_output=True, text=True,
                         timeout=60, env=env)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]


def test_ray_as_the_operator_starts_it_refuses_a_client_without_the_token(tmp_path: Path) -> None:
    pod = _pod_env(tmp_path)
    assert pod["RAY_AUTH_MODE"] == "token"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ra-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    head = subprocess.Popen([RAY, "start", "--head", "--port", str(port), "--num-cpus", "1",
                             "--include-dashboard", "false", "--block", "--temp-dir", temp],
                            env=base | pod, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not (seen := _probe(address, base | pod)).startswith("ok"):
            assert time.monotonic() < deadline and head.poll() is None, seen
            time.sleep(1)
        assert _probe(address, base | {"RAY_AUTH_MODE": "disabled"}).startswith("refused AuthenticationError")
        wrong = base | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
        assert _probe(address, wrong).startswith("refused AuthenticationError")
    finally:
        try:  # only the Ray this test started (its own session); nothing in it to drain
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(10)
        shutil.rmtree(temp, ignore_errors=True)
