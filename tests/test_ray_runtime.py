"""`fusedserve run` as a user starts it: embedded Ray, rank actors, group controller, HTTP API.

Runs the real CLI in a subprocess (inside the suite's private network namespace) and talks to
it with the `openai` client, httpx and prometheus-client's parser.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, example: str) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "fusedserve.cli", "run", example, "--port", str(self.port)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Ready once the CLI has printed its first completion and acceptance figure.
        assert self.proc.stdout is not None
        self.output: list[str] = []
        for line in self.proc.stdout:
            self.output.append(line)
            if "acceptance length:" in line:
                break
        if self.proc.poll() is not None or not self.output or "acceptance length:" not in self.output[-1]:
            self.stop()
            raise RuntimeError("fusedserve run failed:\n" + "".join(self.output[-30:]))
        assert httpx.get(f"{self.url}/health", timeout=5).status_code == 200

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for s in fam.samples:
                key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())
                                       if k in ("op", "group", "position", "finished_reason", "path"))
                out[key] = out.get(key, 0.0) + s.value
        return out

    def status(self) -> dict:  # type: ignore[type-arg]
        return httpx.get(f"{self.url}/status", timeout=30).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def tiny_code() -> Iterator[Server]:
    server = Server("examples/01-tiny-code.yaml")
    yield server
    server.stop()
    assert server.proc.returncode == 0


def test_completion_chat_and_stream_with_speculation(tiny_code: Server) -> None:
    client = tiny_code.client()
    before = tiny_code.metrics()
    comp = client.completions.create(model="tiny-code", prompt="def add(a, b):", max_tokens=24, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage is not None
    chat = client.chat.completions.create(model="tiny-code", messages=[{"role": "user", "content": "import sys"}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.content
    chunks = client.completions.create(model="tiny-code", prompt="def add(a, b):", max_tokens=24, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    after = tiny_code.metrics()
    generated = after["fusedserve_generation_tokens_total"] - before.get("fusedserve_generation_tokens_total", 0)
    assert generated == comp.usage.completion_tokens * 2 + chat.usage.completion_tokens  # type: ignore[union-attr]
    drafts = after["fusedserve_spec_decode_drafts_total"] - before.get("fusedserve_spec_decode_drafts_total", 0)
    accepted = (after["fusedserve_spec_decode_accepted_tokens_total"]
                - before.get("fusedserve_spec_decode_accepted_tokens_total", 0))
    assert drafts > 0 and 0 <= accepted <= 3 * drafts
    # every verify step yields its accepted drafts + 1 token (the last step may be cut by max_tokens)
    assert generated <= accepted + drafts + 3 * 1


def test_bad_request_gets_openai_style_4xx(tiny_code: Server) -> None:
    r = httpx.post(f"{tiny_code.url}/v1/completions", json={"model": "tiny-code", "prompt": "x", "max_tokens": -1})
    assert 400 <= r.status_code < 500 and "error" in r.json()


def test_killed_rank_leads_to_a_recreated_group_that_serves_again(tiny_code: Server) -> None:
    status = tiny_code.status()
    pid = status["groups"][0]["ranks"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 180
    while time.time() < deadline:
        s = tiny_code.status()
        if s["restarts"] >= 1 and s["groups"] and s["groups"][0]["phase"] == "Ready" \
                and s["groups"][0]["ranks"][0]["pid"] != pid:
            break
        time.sleep(1)
    else:
        pytest.fail(f"group was not recreated: {tiny_code.status()}")
    assert s["failures"] and s["failures"][-1]["group"] == 0
    comp = tiny_code.client().completions.create(model="tiny-code", prompt="x = ", max_tokens=4, temperature=0)
    assert comp.choices[0].text is not None


def test_tp2_group_executes_exactly_the_planned_collectives() -> None:
    server = Server("examples/02-tiny-code-tp2.yaml")
    try:
        server.client().completions.create(model="tiny-code-tp2", prompt="class A:", max_tokens=16, temperature=0)
        m = server.metrics()
        forwards = m["fusedserve_forwards_total"]
        assert forwards > 0
        planned = {k.split(",", 1)[1]: v for k, v in m.items()
                   if k.startswith("fusedserve_collective_planned_calls_per_forward,")}
        assert planned, m.keys()
        for key, per_forward in planned.items():
            executed = sum(v for k, v in m.items() if k.startswith("fusedserve_collective_calls_total,")
                           and all(part in k for part in key.split(",")))
            assert executed == per_forward * forwards, (key, executed, per_forward, forwards)
        assert any("path=reference_fused" in k for k in m if k.startswith("fusedserve_collective_calls_total"))
    finally:
        server.stop()
