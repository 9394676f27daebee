"""`fusedserve run` on Ray as a user runs it: placement groups, rank actors, group controller, HTTP API.

One Ray for the whole session (conftest's ``ray_address``, inside the suite's private network namespace, with
``fake_gpu`` standing in for GPUs); every server is the real CLI in a subprocess that joins it
with ``--ray-address``. The tests talk to it with the `openai` client, httpx and
prometheus-client's parser, and kill rank actors with ``ray.kill``.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import APIError

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.*` importable under a bare `pytest` too
    sys.path.append(str(ROOT))

from tests.serve_process import NAMESPACE, ExampleServers, Server, live_groups

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def tiny_code(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """examples/01 (tp=1, EAGLE3), from a copy of the manifest that a test may change."""
    manifest = tmp_path_factory.mktemp("manifest") / "01-tiny-code.yaml"
    manifest.write_text((ROOT / "examples/01-tiny-code.yaml").read_text())
    server = Server(manifest, ray_address)
    yield server
    assert server.stop() == 0, "".join(server.output[-30:])
    assert live_groups("tiny-code") == []  # Ctrl-C removed the placement groups


def test_completion_chat_and_stream_with_speculation(tiny_code: Server) -> None:
    client = tiny_code.client()
    before = {n: tiny_code.total(n) for n in ("fusedserve_generation_tokens_total", "fusedserve_spec_decode_drafts_total",
                                              "fusedserve_spec_decode_accepted_tokens_total")}
    comp = client.completions.create(model="tiny-code", prompt="def add(a, b):", max_tokens=24, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage is not None
    chat = client.chat.completions.create(model="tiny-code", messages=[{"role": "user", "content": "import sys"}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.content and chat.usage is not None
    chunks = client.completions.create(model="tiny-code", prompt="def add(a, b):", max_tokens=24, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    generated = tiny_code.total("fusedserve_generation_tokens_total") - before["fusedserve_generation_tokens_total"]
    assert generated == 2 * comp.usage.completion_tokens + chat.usage.completion_tokens
    drafts = tiny_code.total("fusedserve_spec_decode_drafts_total") - before["fusedserve_spec_decode_drafts_total"]
    accepted = (tiny_code.total("fusedserve_spec_decode_accepted_tokens_total")
                - before["fusedserve_spec_decode_accepted_tokens_total"])
    assert drafts > 0 and 0 <= accepted <= 3 * drafts
    # each request's first token comes from its prefill, then every verify step yields its accepted
    # drafts + 1 token (the last step of a request may be cut short by max_tokens)
    assert generated <= accepted + drafts + 3
    assert re.search(r"acceptance length: \d\.\d\d", "".join(tiny_code.output))


def test_bad_request_gets_openai_style_4xx(tiny_code: Server) -> None:
    r = httpx.post(f"{tiny_code.url}/v1/completions", json={"model": "tiny-code", "prompt": "x", "max_tokens": -1})
    assert 400 <= r.status_code < 500 and "error" in r.json()


def test_status_shows_groups_ranks_placement_and_acceptance(tiny_code: Server) -> None:
    s = tiny_code.status()
    assert s["ready"] and s["ready_replicas"] == s["replicas"] == 1
    [g] = s["groups"]
    assert g["placement_group"] == "fusedserve/default/tiny-code/0" and g["strategy"] == "STRICT_PACK"
    assert g["bundles"] == [{"CPU": 0.25, "fake_gpu": 1.0}] and g["phase"] == "Ready"
    assert g["acceptance_length"] is not None and g["acceptance_length"] >= 1.0
    [rank] = g["ranks"]
    assert rank["role"] == "leader" and rank["node"] == "127.0.0.1" and rank["pid"] > 0
    assert live_groups("tiny-code") == ["fusedserve/default/tiny-code/0"]


def _kill_mid_stream(server: Server, actor_name: str) -> None:
    """Kill a rank actor while a streamed request is in flight: the stream must end with an error."""
    import ray

    stream = server.client().completions.create(model=server.model, prompt="def long(", max_tokens=400,
                                                temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)  # the request is running
    ray.kill(ray.get_actor(actor_name, namespace=NAMESPACE))
    t0 = time.time()
    with pytest.raises(APIError, match="engine is unavailable"):
        for _ in chunks:
            pass
    assert time.time() - t0 < 30


def test_killed_rank_fails_its_request_and_the_group_is_recreated(tiny_code: Server) -> None:
    pid = tiny_code.status()["groups"][0]["ranks"][0]["pid"]
    _kill_mid_stream(tiny_code, "fusedserve/default/tiny-code/0/rank0")
    s = tiny_code.wait_status(lambda s: s["restarts"] >= 1 and s["ready"]
                              and s["groups"][0]["ranks"][0]["pid"] != pid)
    assert s["last_failure"]["group"] == 0 and s["last_failure"]["kind"] == "RankFailed"
    assert "rank 0" in s["last_failure"]["reason"], s["last_failure"]
    assert tiny_code.complete() is not None


def test_spec_change_rolls_the_group_while_requests_keep_succeeding(tiny_code: Server) -> None:
    before = tiny_code.status()
    old_pid = before["groups"][0]["ranks"][0]["pid"]
    manifest = Path(tiny_code.manifest)
    manifest.write_text(manifest.read_text().replace("maxSequences: 16", "maxSequences: 8"))
    errors: list[APIError] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            try:
                tiny_code.complete(max_tokens=2)
            except APIError as e:
                errors.append(e)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        tiny_code.proc.send_signal(signal.SIGHUP)
        s = tiny_code.wait_status(lambda s: s["revision"] != before["revision"] and s["updated_replicas"] == 1
                                  and len(s["groups"]) == 1)
    finally:
        done.set()
        t.join(timeout=60)
    assert errors == []
    [g] = s["groups"]
    assert not g["outdated"] and g["ranks"][0]["pid"] != old_pid
    assert g["placement_group"] == "fusedserve/default/tiny-code/1"  # the surge group took the next index
    assert live_groups("tiny-code") == ["fusedserve/default/tiny-code/1"]


def test_a_restarted_controller_readopts_its_groups(tiny_code: Server, ray_address: str) -> None:
    s = tiny_code.status()
    pid = s["groups"][0]["ranks"][0]["pid"]
    tiny_code.stop(signal.SIGKILL)  # no cleanup: the detached placement group and actors stay
    assert live_groups("tiny-code") == [s["groups"][0]["placement_group"]]
    again = Server(tiny_code.manifest, ray_address)
    tiny_code.proc, tiny_code.url, tiny_code.output = again.proc, again.url, again.output  # the fixture stops it
    tiny_code.port = again.port
    s = tiny_code.status()
    [g] = s["groups"]
    assert g["adopted"] and g["ranks"][0]["pid"] == pid and s["restarts"] == 0
    assert tiny_code.complete() is not None


def test_a_group_larger_than_the_cluster_is_reported_with_the_reason(ray_address: str) -> None:
    """Ray itself says the group cannot be placed (INFEASIBLE): the reason names the resource."""
    from fusedserve.worker.ray.engine_group import EngineGroup, GroupUnschedulable
    from fusedserve.worker.ray.placement import ClusterShape
    from fusedserve.worker.spec import RuntimeConfig, load_manifest

    manifest = load_manifest(str(ROOT / "examples/02-tiny-code-tp2.yaml"))
    spec = manifest.spec.model_copy(update={"parallelism": manifest.spec.parallelism.model_copy(update={"tensor": 8})})
    # a name of its own: examples/02 itself may be serving on this Ray (conftest's example_servers)
    metadata = manifest.metadata.model_copy(update={"name": "tiny-code-tp8"})
    rc = RuntimeConfig.from_manifest(manifest.model_copy(update={"spec": spec, "metadata": metadata}))
    t0 = time.time()
    with pytest.raises(GroupUnschedulable, match="needs 8 fake_gpu, cluster has 6"):
        EngineGroup.create(rc, 0, ClusterShape("fake_gpu", 8))
    assert time.time() - t0 < 10 and live_groups("tiny-code-tp8") == []


def test_tp2_executes_exactly_the_planned_collectives_on_every_rank(example_servers: ExampleServers) -> None:
    """examples/02 (shared: conftest's ``example_servers``; its counters may hold earlier traffic too: executed ==
    planned holds for every forward)."""
    [server] = example_servers.get("tiny-code-tp2").values()
    server.client().completions.create(model="tiny-code-tp2", prompt="class A:", max_tokens=16, temperature=0)
    samples = server.samples()
    for rank in ("0", "1"):
        mine = [s for s in samples if s.labels.get("rank") == rank]
        forwards = sum(s.value for s in mine if s.name == "fusedserve_forwards_total")
        planned = {(s.labels["op"], s.labels["group"]): s.value for s in mine
                   if s.name == "fusedserve_collective_planned_calls_total"}
        assert forwards > 0 and planned, [s.name for s in mine]
        executed: dict[tuple[str, str], float] = {}
        for s in mine:
            if s.name == "fusedserve_collective_calls_total":
                key = (s.labels["op"], s.labels["group"])
                executed[key] = executed.get(key, 0) + s.value
        assert executed == planned, (rank, executed, planned, forwards)
    paths = {s.labels["path"] for s in samples if s.name == "fusedserve_collective_calls_total"}
    assert "reference_fused" in paths  # allReduceFusion: on -> the reference kernel on CPU
    for rank in ("0", "1"):  # every gloo collective is timed; counts match the calls
        timed = {(s.labels["op"], s.labels["path"]): s.value for s in samples
                 if s.name == "fusedserve_collective_seconds_count" and s.labels.get("rank") == rank}
        calls = {(s.labels["op"], s.labels["path"]): s.value for s in samples
                 if s.name == "fusedserve_collective_calls_total" and s.labels.get("rank") == rank}
        assert timed and timed == calls, (rank, timed, calls)
    status = server.status()
    [g] = status["groups"]
    assert g["collectives_match_plan"] is True and [r["role"] for r in g["ranks"]] == ["leader", "follower"]
    # a follower dies mid-request: the leader's collectives fail, the request errors, the group comes back
    _kill_mid_stream(server, "fusedserve/default/tiny-code-tp2/0/rank1")
    s = server.wait_status(lambda s: s["restarts"] > status["restarts"] and s["ready"])
    assert "rank 1" in s["last_failure"]["reason"], s["last_failure"]
    assert server.complete() is not None


def _single_rank_completions(model_dir: Path, prompts: list[str], max_tokens: int) -> dict[str, str]:
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    engine = Engine(model_dir, EngineConfig(num_blocks=64))
    done = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return {p: c.text for p, c in zip(prompts, done)}


@pytest.mark.parametrize("tensor", [pytest.param(2, id="examples-03", marks=pytest.mark.example_servers),
                                    pytest.param(4, id="tp4-attn-tp2")])
def test_moe_with_dp_attention_and_expert_parallelism_serves_on_both_dp_groups(
        ray_address: str, tensor: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """examples/03 (tp=2, dp=2: one rank per DP group; shared: conftest's ``example_servers``, so its counters
    are read as deltas) and a tp=4 variant whose DP groups have two ranks each (the DP leaders broadcast their
    batches to an attention-TP follower)."""
    if tensor == 2:
        [server] = request.getfixturevalue("example_servers").get("tiny-moe").values()
    else:
        text = (ROOT / "examples/03-tiny-moe-dp-ep.yaml").read_text().replace("tensor: 2,", f"tensor: {tensor},")
        manifest = tmp_path / "moe.yaml"
        manifest.write_text(text)
        server = Server(manifest, ray_address)
    try:
        before = {dp: server.total("fusedserve_request_success_total", dp_rank=dp) for dp in ("0", "1")}
        prompts = ["def f(x):", "import os", "class B:", "for i in"]
        results: dict[str, str] = {}
        threads = [threading.Thread(target=lambda p=p: results.update({p: server.complete(p, max_tokens=8)}))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        # the same greedy tokens as one rank with no parallelism at all (both DP groups busy, batches
        # of different sizes, padding, empty forwards)
        assert results == _single_rank_completions(ROOT / "examples/checkpoints/tiny-moe", prompts, 8)
        chat = server.client().chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length")
        served = {dp: server.total("fusedserve_request_success_total", dp_rank=dp) - before[dp] for dp in ("0", "1")}
        assert served["0"] >= 2 and served["1"] >= 2, served  # each DP group scheduled its own requests
        # every rank ran the same number of forwards (idle DP groups run empty ones)
        forwards = {server.total("fusedserve_forwards_total", rank=str(r)) for r in range(tensor)}
        assert len(forwards) == 1 and forwards.pop() > 0
        [g] = server.status()["groups"]
        attn_tp = tensor // 2
        assert [r["role"] for r in g["ranks"]] == ["leader" if r % attn_tp == 0 else "follower" for r in range(tensor)]
    finally:
        if tensor != 2:  # the shared one stops after its last test (conftest)
            assert server.stop() == 0


def _manifest(tmp_path: Path, name: str, replace: dict[str, str]) -> Path:
    """examples/01 as a deployment of its own, ``tiny-code-<name>``: the ``tiny_code`` fixture's controller is
    still running on this Ray, and two controllers of one deployment adopt (and remove) each other's groups."""
    text = (ROOT / "examples/01-tiny-code.yaml").read_text()
    meta = "metadata:\n  name: tiny-code\n"
    assert meta in text
    text = text.replace(meta, f"metadata:\n  name: tiny-code-{Path(name).stem}\n")
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def test_replicas_zero_serves_health_not_ready_and_503_until_scaled_up(ray_address: str, tmp_path: Path) -> None:
    """Issue 18: `replicas: 0` crashed `fusedserve run` (its warm-up request needs a ready group)."""
    from fusedserve.worker.ray.launcher import NO_GROUPS_MARK

    manifest = _manifest(tmp_path, "zero.yaml", {"replicas: 1": "replicas: 0"})
    server = Server(manifest, ray_address, ready_mark=NO_GROUPS_MARK)
    try:
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "unavailable"}
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-code", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        assert r.json()["error"]["code"] == "no_ready_engine" and "no ready engine groups" in r.json()["error"]["message"]
        s = server.status()
        assert s["ready"] is False and s["replicas"] == 0 and s["groups"] == []
        manifest.write_text(manifest.read_text().replace("replicas: 0", "replicas: 1"))  # scale up
        server.proc.send_signal(signal.SIGHUP)
        server.wait_status(lambda s: s["ready"] and s["ready_replicas"] == 1)
        assert server.complete() is not None
    finally:
        assert server.stop() == 0, "".join(server.output[-30:])


def test_sigterm_drains_requests_in_flight_and_the_api_key_guards_the_api(ray_address: str, tmp_path: Path) -> None:
    """Issue 18: SIGTERM with requests in flight gave 500 text/plain and cut streams. Now each request in
    flight gets its result or a well-formed error, then the process exits 0 and removes its groups.
    The key comes from $FUSEDSERVE_API_KEY (as the operator injects it from a Secret)."""
    import json
    import os

    key = "fs-e2e-3f9a"
    manifest = _manifest(tmp_path, "drain.yaml", {"port: 8000": "port: 8000, drainGracePeriodSeconds: 3"})
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "FUSEDSERVE_API_KEY": key}
    server = Server(manifest, ray_address, api_key=key, env=env)
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny-code", "prompt": "def long(", "temperature": 0, "ignore_eos": True}
    assert httpx.post(url, json={**body, "max_tokens": 2}, timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/status", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # probes carry no key
    assert httpx.post(url, json={**body, "max_tokens": 2}, headers=server.headers, timeout=30).status_code == 200
    results: list[tuple[str, int, str]] = []

    def plain(max_tokens: int) -> None:
        r = httpx.post(url, json={**body, "max_tokens": max_tokens}, headers=server.headers, timeout=60)
        results.append(("plain", r.status_code, r.text))

    def stream() -> None:
        with httpx.stream("POST", url, json={**body, "max_tokens": 800, "stream": True}, headers=server.headers,
                          timeout=60) as r:
            if r.status_code != 200:  # arrived after the drain began: refused whole, before any event
                results.append(("stream", r.status_code, r.read().decode()))
                return
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            results.append(("stream", r.status_code, "\n".join(lines)))

    threads = [threading.Thread(target=plain, args=(n,)) for n in (4, 800, 800)]
    threads += [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while sum(g["num_requests_running"] + g["num_requests_waiting"] for g in
              (r for g in server.status()["groups"] for r in g["ranks"] if r["role"] == "leader")) < 5:
        assert time.time() < deadline, server.status()
        time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    assert server.proc.wait(timeout=60) == 0, "".join(server.output[-30:])
    assert len(results) == 6
    for kind, status, text in results:
        if kind == "plain":
            assert status == 200 or (status == 503 and json.loads(text)["error"]["code"] == "shutting_down"), text
        elif status != 200:  # only a request the server had not yet received when SIGTERM came (5 of 6 were in)
            assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down", text
        else:
            events = [line.removeprefix("data: ") for line in text.splitlines()]
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            assert "choices" in last or last["error"]["code"] == "shutting_down", events[-3:]
    # at least 5 of the 6 were running or waiting at SIGTERM: at most one stream was refused whole
    assert sum(kind == "stream" and status == 200 for kind, status, _ in results) >= 2, results
    assert "draining" in "".join(server.output)
    assert live_groups("tiny-code-drain") == []
