"""The API key and what ``/status`` tells whom (issue 18: the API had no authentication, ``/status``
showed PIDs, node addresses and failure texts to anyone). A real server over the tiny code model;
``fusedserve run --api-key`` / ``$FUSEDSERVE_API_KEY`` end to end is in tests/test_ray_runtime.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.serving.access import ApiAccess, bearer_token
from fusedserve.worker.serving.http_api import build_app
from fusedserve.worker.serving.http_server import HttpServer
from fusedserve.worker.serving.local_engine_client import LocalEngineClient
from fusedserve.worker.serving.metrics import MetricsRegistry
from fusedserve.worker.serving.status_view import public_status

MODEL_DIR = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code"
KEY = "fs-test-7d1c0b9a"


@pytest.fixture(scope="module")
def client() -> Iterator[LocalEngineClient]:
    engine = Engine(MODEL_DIR, EngineConfig(num_blocks=64, max_model_len=256, dtype="float32", seed=0))
    c = LocalEngineClient(engine, {"deployment": "t"}, model_name="tiny-code")
    yield c
    c.close()


def serve(client: LocalEngineClient, access: ApiAccess) -> HttpServer:
    return HttpServer(build_app(client, MetricsRegistry(client.labels, "tiny-code"), access=access))


def get(url: str, key: str | None = None, scheme: str = "Bearer") -> httpx.Response:
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    return httpx.get(url, headers=headers, timeout=30)


def test_without_the_key_401_with_it_200(client: LocalEngineClient) -> None:
    with serve(client, ApiAccess(KEY)) as server:
        for path in ("/v1/models", "/status", "/v1/nothing"):  # unknown routes too: no probing them
            for key, scheme in ((None, "Bearer"), ("wrong", "Bearer"), (KEY[:-1], "Bearer"), (KEY, "Basic"),
                                (f"{KEY}x", "Bearer")):
                r = get(server.url + path, key, scheme)
                assert r.status_code == 401, (path, key, scheme, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
        assert get(server.url + "/v1/models", KEY).status_code == 200
        assert get(server.url + "/status", KEY).json()["ready"] is True
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        comp = oai.completions.create(model="tiny-code", prompt="def f(", max_tokens=3, temperature=0)
        assert comp.usage is not None and comp.usage.completion_tokens == 3
        # probes and scrapes carry no key: public unless spec.serving.auth says apiKey
        assert get(server.url + "/health").status_code == 200
        assert get(server.url + "/metrics").status_code == 200


def test_health_and_metrics_can_need_the_key_too(client: LocalEngineClient) -> None:
    with serve(client, ApiAccess(KEY, health_needs_key=True, metrics_needs_key=True)) as server:
        for path in ("/health", "/metrics"):
            assert get(server.url + path).status_code == 401
            assert get(server.url + path, KEY).status_code == 200


def test_status_hides_pids_nodes_and_failure_texts_from_those_who_may_not_see_them(client: LocalEngineClient) -> None:
    with serve(client, ApiAccess(status_details=False)) as server:  # no key, not on loopback only
        doc = get(server.url + "/status").json()
    assert doc["ready"] is True and "error" not in doc and doc["groups"][0]["labels"]["deployment"] == "t"
    full = {"ready": False, "groups": [{"index": 0, "phase": "Ready", "ranks": [
        {"rank": 0, "role": "leader", "node": "10.1.2.3", "pid": 4711, "actor_id": "abc", "error": None}]}],
        "last_failure": {"group": 0, "time": 1.0, "kind": "RankFailed",
                         "reason": "ActorDiedError: The actor died ... node 7f3e ... OOM killer"},
        "failures": [{"group": 0, "time": 1.0, "kind": "RankFailed", "reason": "x"}],
        "conditions": [{"type": "Ready", "status": False, "message": "0/1 engine groups ready"},
                       {"type": "Scheduled", "status": False, "reason": "Unschedulable", "message": "needs 8 GPU"}]}
    view: dict[str, Any] = public_status(full)
    assert view["groups"][0]["ranks"] == [{"rank": 0, "role": "leader"}]
    assert view["last_failure"]["kind"] == "RankFailed" and view["last_failure"]["reason"].startswith("RankFailed (")
    assert view["conditions"] == full["conditions"] and "OOM" not in str(view) and "10.1.2.3" not in str(view)


def test_bearer_token_parsing() -> None:
    assert bearer_token([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_token([(b"Authorization", b"bearer  abc ")]) == b"abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([]) is None
    assert "fs-test" not in repr(ApiAccess(KEY))
