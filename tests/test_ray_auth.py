"""Ray's token authentication, the one mechanism of ``fusedserve.worker.ray.auth_token`` (``RAY_AUTH_MODE=token``,
the token in the file ``RAY_AUTH_TOKEN_PATH`` names), asked of Ray itself with its own GCS client (issue 18:
the head started Ray with its dashboard on 0.0.0.0, ports open and no authentication, so anyone on the
network could submit jobs, i.e. run code).

- As the operator configures it (``operator/ray_auth.py``): a real Ray head started with the head
  container's environment and the token Secret's value admits a client that has the token and refuses one
  without it, or with another.
- The embedded Ray of `fusedserve run` (no ``--ray-address``, no ``RAY_AUTH_MODE`` in its environment): a
  fresh token of the run in a file only its user reads, removed at exit; no dashboard, 127.0.0.1 only (its
  ranks' rendezvous too: a file, removed at exit); a
  call without the token or with a wrong one is refused (``AuthenticationError: InvalidAuthToken``), the
  same call with the run's token file is answered; ``ray.init`` without a token is refused.

Runs in the suite's private network namespace (TESTING.md).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `tests.*` importable under a bare `pytest` too
    sys.path.append(str(REPO))

from fusedserve.operator.children import Context, desired_children, parse_spec
from fusedserve.operator.naming import Owner
from fusedserve.operator.ray_auth import TOKEN_DIR, TOKEN_KEY, desired_token_secret
from fusedserve.worker.ray import auth_token
from tests.serve_process import Server, free_port

pytestmark = pytest.mark.ray
RAY = str(Path(sys.executable).with_name("ray"))
PROBE = """
import sys
from ray._raylet import GcsClient
try:
    nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=20)
except Exception as e:
    print("refused", type(e).__name__, str(e).splitlines()[0][:300])
else:
    print("ok", len(nodes), "node(s)")
"""


def _probe(address: str, env: dict[str, Any]) -> str:
    """Ray's own GCS client (a process of its own: Ray reads its auth settings once per process)."""
    out = subprocess.run([sys.executable, "-c", PROBE, address], check=False, capture_output=True, text=True,
                         timeout=120, env=env)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]


def _base_env(home: Path) -> dict[str, str]:
    """This environment without any Ray auth setting, and a home without anyone's ~/.ray/auth_token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    return env | {"HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}


def _refused(answer: str) -> bool:
    return answer.startswith("refused AuthenticationError") and "InvalidAuthToken" in answer


# --- as the operator starts it -------------------------------------------------------------------


def _pod_env(tmp_path: Path) -> dict[str, str]:
    """The head container's Ray environment, its token file mounted from the Secret into ``tmp_path``."""
    body = yaml.safe_load((REPO / "examples" / "01-tiny-code.yaml").read_text())
    owner = Owner.of(body)
    head = desired_children(owner, parse_spec(body), Context()).ray_cluster["spec"]["headGroupSpec"]
    env = {e["name"]: e["value"] for e in head["template"]["spec"]["containers"][0]["env"] if "value" in e}
    secret = desired_token_secret(owner, auth_token.new_token())
    mount = tmp_path / "ray-token"
    mount.mkdir()
    (mount / TOKEN_KEY).write_bytes(base64.b64decode(secret["data"][TOKEN_KEY]))
    assert env[auth_token.TOKEN_PATH_ENV] == f"{TOKEN_DIR}/{TOKEN_KEY}"
    env[auth_token.TOKEN_PATH_ENV] = str(mount / TOKEN_KEY)
    return env


def test_ray_as_the_operator_starts_it_refuses_a_client_without_the_token(tmp_path: Path) -> None:
    pod = _pod_env(tmp_path)
    assert pod[auth_token.MODE_ENV] == "token"
    base = _base_env(tmp_path)
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
        assert _refused(_probe(address, base | {"RAY_AUTH_MODE": "disabled"}))
        assert _refused(_probe(address, base | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}))
    finally:
        try:  # only the Ray this test started (its own session); nothing in it to drain
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


# --- the embedded Ray of `fusedserve run` ---------------------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, Path]]:
    """examples/02 (two ranks: a rendezvous too) on the embedded Ray, its temporary files in a folder of its own."""
    home = tmp_path_factory.mktemp("home")
    # short: Ray puts its sockets under $TMPDIR and their paths must fit 107 bytes (an xdist worker's tmp_path
    # does not leave room)
    temp = Path(tempfile.mkdtemp(prefix="re-", dir="/tmp"))
    try:
        server = Server(REPO / "examples/02-tiny-code-tp2.yaml", None, timeout=240,
                        env=_base_env(home) | {"TMPDIR": str(temp)})
        token_file: Path | None = None
        try:
            banner = "".join(server.output)
            match = re.search(r"Ray: embedded at (127\.0\.0\.1:\d+), no dashboard, token authentication", banner)
            assert match, banner
            token_file = _token_file_of_children(server.proc.pid)
            yield server, match.group(1), token_file
        finally:
            assert server.stop() == 0, "".join(server.output[-30:])
            if token_file is not None:
                assert not token_file.exists() and not token_file.parent.exists(), "the run's token outlived it"
            assert not list(temp.glob("fusedserve-rendezvous-*")), "the ranks' rendezvous file outlived the run"
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    children: dict[int, list[int]] = {}
    for proc_stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = proc_stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(proc_stat.parent.name))
    return children


def _token_file_of_children(pid: int) -> Path:
    """The run's token file, as its Ray processes (children of the CLI) got it in their environment."""
    key = f"{auth_token.TOKEN_PATH_ENV}=".encode()
    for child in _children().get(pid, ()):
        try:
            environ = (Path("/proc") / str(child) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        assert not any(e.startswith(b"RAY_AUTH_TOKEN=") for e in environ), "the token itself is in an environment"
        for entry in environ:
            if entry.startswith(key):
                return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError(f"no child of {pid} holds {auth_token.TOKEN_PATH_ENV}")


def test_embedded_ray_refuses_a_client_without_the_token(embedded: tuple[Server, str, Path], tmp_path: Path) -> None:
    server, address, token_file = embedded
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    base = _base_env(tmp_path)
    for wrong in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):
        answer = _probe(address, base | wrong)
        assert _refused(answer), answer
    assert _probe(address, base | auth_token.token_env(str(token_file))) == "ok 1 node(s)"  # with the run's token
    env = base | {"RAY_AUTH_MODE": "token"}  # no token anywhere
    out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}')"], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "AuthenticationError" in out.stderr, out.stderr[-2000:]
    assert server.complete() is not None  # the server itself goes on serving


def _process_tree(root: int) -> set[int]:
    """``root`` and every process below it (Ray's daemons are the server's children, its workers the raylet's)."""
    children = _children()
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, ()))
    return tree


def test_embedded_ray_has_no_dashboard_and_listens_on_loopback_only(embedded: tuple[Server, str, Path]) -> None:
    """Ray's servers, the HTTP API and the two ranks (they rendezvous in a file: torch's TCP store would listen on
    every interface) — on 127.0.0.1 alone."""
    server, address, _ = embedded
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", 8265), timeout=2).close()
    # The sockets of this server's processes only: under xdist another worker's tests listen beside it.
    tree = _process_tree(server.proc.pid)
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=False).stdout
    ours = [line for line in listening.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", line)} & tree]
    ports = {line.split()[3].rsplit(":", 1)[1] for line in ours}
    assert address.rsplit(":", 1)[1] in ports and str(server.port) in ports, (address, server.port, listening)
    addresses = {line.split()[3].rsplit(":", 1)[0] for line in ours}
    assert addresses <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, "\n".join(ours)
