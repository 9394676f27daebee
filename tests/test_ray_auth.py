"""The embedded Ray of `fusedserve run` (issue 18: Ray's dashboard on 0.0.0.0, ports open, no
authentication, so anyone on the network could submit jobs, i.e. run code).

`fusedserve run` without ``--ray-address`` and without ``RAY_AUTH_MODE`` in its environment starts
Ray with token authentication (a fresh token of the run) and no dashboard, on 127.0.0.1. Ray itself
is asked, with its own GCS client: a call without the token or with a wrong one is refused
(``AuthenticationError: InvalidAuthToken``), the same call with the run's token is answered;
``ray.init`` without a token is refused.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from tests.serve_process import Server

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, str]]:
    home = tmp_path_factory.mktemp("home")  # no ~/.ray/auth_token of anyone else
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    server = Server(ROOT / "examples/01-tiny-code.yaml", None, timeout=240, env=env)
    try:
        banner = "".join(server.output)
        match = re.search(r"Ray: embedded at (127\.0\.0\.1:\d+), no dashboard, token authentication", banner)
        assert match, banner
        yield server, match.group(1), _token_of_children(server.proc.pid)
    finally:
        assert server.stop() == 0, "".join(server.output[-30:])


def _token_of_children(pid: int) -> str:
    """The run's token, as its Ray processes (children of the CLI) got it in their environment."""
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            for entry in (proc / "environ").read_bytes().split(b"\0"):
                if entry.startswith(b"RAY_AUTH_TOKEN="):
                    return entry.split(b"=", 1)[1].decode()
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no child of {pid} holds RAY_AUTH_TOKEN")


GCS_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=20)
except Exception as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0][:300])
else:
    print("OK", len(nodes), "node(s)")
"""


def _gcs_call(address: str, mode: str, token: str | None, home: Path) -> str:
    """Ray's own GCS client (a process of its own: Ray reads its auth settings once per process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE=mode, HOME=str(home), **({"RAY_AUTH_TOKEN": token} if token is not None else {}))
    out = subprocess.run([sys.executable, "-c", GCS_PROBE, address], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]


def test_embedded_ray_refuses_a_client_without_the_token(embedded: tuple[Server, str, str], tmp_path: Path) -> None:
    server, address, token = embedded
    for mode, wrong in (("disabled", None), ("token", "0" * 64)):
        answer = _gcs_call(address, mode, wrong, tmp_path)
        assert answer.startswith("REFUSED AuthenticationError") and "InvalidAuthToken" in answer, answer
    assert _gcs_call(address, "token", token, tmp_path) == "OK 1 node(s)"  # the same call with the run's token
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE="token", HOME=str(tmp_path))  # no token anywhere
    out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}')"], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "AuthenticationError" in out.stderr, out.stderr[-2000:]
    assert server.complete() is not None  # the server itself goes on serving


def test_embedded_ray_has_no_dashboard_and_listens_on_loopback_only(embedded: tuple[Server, str, str]) -> None:
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", 8265), timeout=2).close()
    listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=False).stdout
    addresses = {line.split()[3].rsplit(":", 1)[0] for line in listening.splitlines() if line.strip()}
    assert addresses <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, listening
