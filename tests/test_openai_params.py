"""The OpenAI request parameters against a real server (uvicorn on 127.0.0.1, the real ``openai`` client),
with and without EAGLE3 speculation (tiny-code + tiny-code-eagle3, a chain of 3), checked against
references computed here from HuggingFace transformers' fp32 logits of the same token prefixes:

- logprobs (completions top-n with echo, chat top_logprobs) equal ``log_softmax`` of HF's logits
  (|diff| <= 2e-4 on tiny-code, whose logits stay below ~10; 2e-3 on SmolLM2, whose fp32 logits carry
  HF's own ~5e-4 attention-kernel noise);
- each penalty, logit_bias and min_tokens: every greedy token is the argmax of HF's logits adjusted by
  the definition (reference code below, written apart from the server's) with the history at that
  position; min_p and logit_bias under sampling: every sampled token lies in the support the
  definition allows (and without min_p some does not);
- json_schema output parses and validates (jsonschema) for 20 schemas;
- every OpenAI parameter of both endpoints is honoured (200) or refused with a 400 naming it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.tokenizer import Tokenizer
from fusedserve.worker.serving.http_api import build_app
from fusedserve.worker.serving.http_server import HttpServer
from fusedserve.worker.serving.local_engine_client import LocalEngineClient
from fusedserve.worker.serving.metrics import MetricsRegistry
from fusedserve.worker.spec_decode.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples/checkpoints/tiny-code"
DRAFT = ROOT / "examples/checkpoints/tiny-code-eagle3"
MODEL = "tiny-code"
PROMPT = "def fib(n):"
EOS = 0  # tiny-code's eos_token_id


@dataclass
class Served:
    url: str
    oai: openai.OpenAI
    model: str
    speculative: bool = False


def serve(model_dir: Path, name: str, speculative: SpeculativeConfig | None) -> Iterator[Served]:
    engine = Engine(model_dir, EngineConfig(num_blocks=96, max_model_len=512, max_num_seqs=8, max_batch_tokens=512,
                                            dtype="float32", seed=0, speculative=speculative))
    client = LocalEngineClient(engine, {"engine_group": "0", "rank": "0"}, model_name=name)
    server = HttpServer(build_app(client, MetricsRegistry(client.labels, name))).start()
    try:
        yield Served(server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120),
                     name, speculative is not None)
    finally:
        server.stop()
        client.close()


@pytest.fixture(scope="module", params=["plain", "eagle3"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    yield from serve(TINY, MODEL, SpeculativeConfig(str(DRAFT), num_steps=3) if request.param == "eagle3" else None)


@pytest.fixture(scope="module")
def plain() -> Iterator[Served]:
    yield from serve(TINY, MODEL, None)


_HF: dict[Path, Any] = {}


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """HF transformers' fp32 logits of every position: [len(ids), vocab]"""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[model_dir](torch.tensor([ids])).logits[0].float()


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def post(s: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(s.url + path, json={"model": s.model, **body}, timeout=120)


def generated(s: Served, **kw: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of a completion of PROMPT."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0, "echo": True,
            "return_tokens_as_token_ids": True, **kw}
    r = post(s, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = ids_of(choice["logprobs"]["tokens"])
    n = r.json()["usage"]["prompt_tokens"]
    return ids[:n], ids[n:]


# --- logprobs --------------------------------------------------------------------------------------------------------

def check_logprobs(s: Served, model_dir: Path, prompt: str, tol: float) -> None:
    r = s.oai.completions.create(model=s.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=5, echo=True,
                                 extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    ids = ids_of(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(ids) == r.usage.prompt_tokens + r.usage.completion_tokens
    ref = torch.log_softmax(hf_logits(model_dir, ids), dim=-1)
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert abs(lp.token_logprobs[i] - float(row[ids[i]])) <= tol, (i, lp.token_logprobs[i], float(row[ids[i]]))
        top = {int(k.removeprefix("token_id:")): v for k, v in lp.top_logprobs[i].items()}
        best = row.topk(5)
        assert len(top) >= 5
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            if t in top:  # a tie at the 5th place may swap equal-valued tokens
                assert abs(top[t] - v) <= tol
        assert sorted(top.values(), reverse=True)[:5] == pytest.approx(best.values.tolist(), abs=tol)
    # greedy: each generated token is the raw argmax (no adjustment asked for)
    n = r.usage.prompt_tokens
    assert ids[n:] == ref[n - 1:-1].argmax(dim=-1).tolist()


def test_completion_logprobs_equal_hf_log_softmax(served: Served) -> None:
    check_logprobs(served, TINY, PROMPT, 2e-4)


def test_chat_logprobs_equal_hf_log_softmax(served: Served) -> None:
    messages = [{"role": "user", "content": "write fib"}]
    prompt_ids = post(served, "/tokenize", {"messages": messages}).json()["tokens"]
    r = served.oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3, extra_body={"return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    out = ids_of([c.token for c in content])
    ref = torch.log_softmax(hf_logits(TINY, prompt_ids + out), dim=-1)[len(prompt_ids) - 1:]
    for i, c in enumerate(content):
        assert abs(c.logprob - float(ref[i, out[i]])) <= 2e-4
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(ref[i].topk(3).values.tolist(), abs=2e-4)
        assert c.bytes == list(c.token.encode())


def test_smollm2_logprobs_equal_hf_log_softmax(smollm2: Path) -> None:
    for s in serve(smollm2, "smollm2", None):
        check_logprobs(s, smollm2, "The capital of France is", 2e-3)


# --- penalties, bias, min_tokens, min_p ------------------------------------------------------------------------------

def reference_adjust(logits: torch.Tensor, prompt: list[int], out: list[int], p: dict[str, Any]) -> torch.Tensor:
    """The parameters' definitions (OpenAI / vLLM docs), one position: logits [vocab] -> [vocab]."""
    x = logits.double().clone()
    if len(out) < p.get("min_tokens", 0):
        x[EOS] = float("-inf")
    for t, b in p.get("logit_bias", {}).items():
        x[int(t)] += b
    rep = p.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in Counter(out).items():
        x[t] -= c * p.get("frequency_penalty", 0.0) + p.get("presence_penalty", 0.0)
    return x


GREEDY_CASES = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"presence_penalty": 0.8, "frequency_penalty": 0.8},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6},
    {"logit_bias": {"291": 4.0, "10": -3.0, "80": 6.0}},
    {"frequency_penalty": 0.7, "presence_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": {"68": 2.5}},
]


@pytest.mark.parametrize("params", GREEDY_CASES, ids=[",".join(c) for c in GREEDY_CASES])
def test_greedy_token_is_the_argmax_of_the_adjusted_logits(served: Served, params: dict[str, Any]) -> None:
    prompt, out = generated(served, **params, max_tokens=16)
    _, unadjusted = generated(served, max_tokens=16)
    assert out != unadjusted, "the parameter changed nothing"
    logits = hf_logits(TINY, prompt + out)
    for i, token in enumerate(out):
        expected = int(reference_adjust(logits[len(prompt) - 1 + i], prompt, out[:i], params).argmax())
        assert token == expected, (i, out)


def test_min_tokens_holds_eos_back(served: Served) -> None:
    bias = {"logit_bias": {str(EOS): 100.0}}
    _, out = generated(served, **bias)
    assert out == [EOS]
    r = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "min_tokens": 5,
                                         "logprobs": 0, "return_tokens_as_token_ids": True, **bias}).json()
    tokens = ids_of(r["choices"][0]["logprobs"]["tokens"])
    assert len(tokens) == 6 and EOS not in tokens[:5] and tokens[5] == EOS
    assert r["choices"][0]["finish_reason"] == "stop"


def sampled(s: Served, seed: int, **kw: Any) -> tuple[list[int], list[int]]:
    return generated(s, temperature=1.0, seed=seed, max_tokens=24, **kw)


def test_min_p_keeps_only_tokens_within_its_ratio(served: Served) -> None:
    outside = 0
    for seed in range(4):
        prompt, out = sampled(served, seed, min_p=0.3)
        probs = torch.softmax(hf_logits(TINY, prompt + out)[len(prompt) - 1:-1].double(), dim=-1)
        chosen = probs[torch.arange(len(out)), torch.tensor(out)]
        assert bool((chosen >= 0.3 * probs.max(dim=-1).values - 1e-6).all()), (seed, out)
        prompt, free = sampled(served, seed)
        probs = torch.softmax(hf_logits(TINY, prompt + free)[len(prompt) - 1:-1].double(), dim=-1)
        chosen = probs[torch.arange(len(free)), torch.tensor(free)]
        outside += int((chosen < 0.3 * probs.max(dim=-1).values).sum())
    assert outside > 0, "without min_p some sampled token lies outside its ratio"


def test_sampled_tokens_avoid_a_banned_logit_bias(served: Served) -> None:
    banned = set(range(60, 600))
    for seed in range(3):
        _, out = sampled(served, seed, logit_bias={str(t): -100.0 for t in banned})
        assert not set(out) & banned, out


def test_seed_is_int64(plain: Served) -> None:
    for seed in (-(2**63), -1, 2**63 - 1):
        a = generated(plain, temperature=1.0, seed=seed)[1]
        assert a == generated(plain, temperature=1.0, seed=seed)[1]
    r = post(plain, "/v1/completions", {"prompt": PROMPT, "seed": 2**63})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_max_tokens_beyond_the_context_is_refused(plain: Served) -> None:
    r = post(plain, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10**12})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "maximum context length" in r.json()["error"]["message"]


# --- structured output -----------------------------------------------------------------------------------------------

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"x": {"type": "null"}}, "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "boolean"}},
                                            "required": ["q"], "additionalProperties": False}},
     "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "b": {"type": "boolean"}}, "required": ["n", "b"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "boolean"},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["v"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-c]{2}$"}}, "required": ["id"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}}, "required": ["s"],
     "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                        "maximum": 3}, "maxItems": 2}},
     "required": ["xs"], "additionalProperties": False},
    {"$defs": {"flag": {"type": "boolean"}}, "type": "object", "properties": {"f": {"$ref": "#/$defs/flag"}},
     "required": ["f"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "on": {"type": "boolean"}},
     "required": ["level", "on"], "additionalProperties": False},
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_output_validates(served: Served, index: int) -> None:
    schema = SCHEMAS[index]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}}
    endpoint = index % 2  # half through chat, half through completions
    if endpoint:
        r = served.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                               max_tokens=96, temperature=0.7, seed=index, response_format=fmt)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    else:
        c = served.oai.completions.create(model=MODEL, prompt="data = ", max_tokens=96, temperature=0.7, seed=index,
                                          extra_body={"response_format": fmt})
        text, reason = c.choices[0].text, c.choices[0].finish_reason
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_invalid_schemas(plain: Served) -> None:
    r = plain.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=96,
                                          temperature=0.7, seed=1, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for bad in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "ten"}}},
                {"type": "xml"}):
        r2 = post(plain, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                   "response_format": bad})
        assert r2.status_code == 400, r2.text
        assert r2.json()["error"]["param"].startswith("response_format"), r2.text


# --- every parameter: honoured or a 400 naming it ---------------------------------------------------------------------

OK, REFUSED = "ok", "400"
# (parameter, value, expected) per endpoint: OpenAI's completions and chat completions parameters (2026 API
# reference) and vLLM's extensions this server takes.
COMPLETIONS = [
    ("model", MODEL, OK), ("prompt", "x", OK), ("best_of", 1, OK), ("best_of", 2, REFUSED), ("echo", True, OK),
    ("frequency_penalty", 0.5, OK), ("logit_bias", {"10": 1.0}, OK), ("logprobs", 2, OK), ("max_tokens", 4, OK),
    ("n", 2, OK), ("presence_penalty", 0.5, OK), ("seed", 3, OK), ("stop", ["\n"], OK), ("stream", False, OK),
    ("stream_options", {"include_usage": True}, REFUSED),  # only with stream=true
    ("suffix", "end", REFUSED), ("temperature", 0.5, OK), ("top_p", 0.9, OK), ("user", "u1", OK),
    ("response_format", {"type": "json_object"}, OK),
    ("top_k", 5, OK), ("min_p", 0.1, OK), ("repetition_penalty", 1.1, OK), ("min_tokens", 1, OK),
    ("ignore_eos", True, OK), ("stop_token_ids", [3], OK), ("prompt_logprobs", 1, OK),
]
CHAT = [
    ("model", MODEL, OK), ("messages", [{"role": "user", "content": "x"}], OK), ("audio", {"voice": "alloy"}, REFUSED),
    ("frequency_penalty", 0.5, OK), ("function_call", "auto", REFUSED), ("function_call", "none", OK),
    ("functions", [{"name": "f"}], REFUSED), ("logit_bias", {"10": 1.0}, OK), ("logprobs", True, OK),
    ("max_completion_tokens", 4, OK), ("max_tokens", 4, OK), ("metadata", {"k": "v"}, OK),
    ("modalities", ["text"], OK), ("modalities", ["text", "audio"], REFUSED), ("n", 2, OK),
    ("parallel_tool_calls", False, OK), ("prediction", {"type": "content", "content": "x"}, REFUSED),
    ("presence_penalty", 0.5, OK), ("prompt_cache_key", "k", OK), ("reasoning_effort", "low", REFUSED),
    ("response_format", {"type": "text"}, OK), ("response_format", {"type": "json_object"}, OK),
    ("safety_identifier", "s", OK), ("seed", -5, OK), ("service_tier", "auto", OK), ("service_tier", "flex", REFUSED),
    ("stop", "\n", OK), ("store", False, OK), ("store", True, REFUSED), ("stream", False, OK),
    ("stream_options", {"include_usage": True}, REFUSED), ("temperature", 0.5, OK),
    ("tool_choice", "none", OK), ("tool_choice", "auto", REFUSED),
    ("tools", [{"type": "function", "function": {"name": "f"}}], REFUSED), ("top_logprobs", 2, REFUSED),  # no logprobs
    ("top_p", 0.9, OK), ("user", "u1", OK), ("verbosity", "low", REFUSED), ("web_search_options", {}, OK),
    ("web_search_options", {"search_context_size": "low"}, REFUSED),
    ("top_k", 5, OK), ("min_p", 0.1, OK), ("repetition_penalty", 1.1, OK), ("min_tokens", 1, OK),
]


@pytest.mark.parametrize("path, table", [("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
def test_every_parameter_is_honoured_or_refused_by_name(plain: Served, path: str, table: list[Any]) -> None:
    base: dict[str, Any] = ({"prompt": "x"} if path == "/v1/completions" else
                            {"messages": [{"role": "user", "content": "x"}]})
    base |= {"max_tokens": 3, "temperature": 0}
    for param, value, expected in table:
        r = post(plain, path, {**base, param: value})
        if expected == OK:
            assert r.status_code == 200, (param, value, r.text)
        else:
            assert r.status_code == 400, (param, value, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"], (param, err)


def test_unknown_fields_are_ignored_with_a_warning(plain: Served, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        r = post(plain, "/v1/completions", {"prompt": "x", "max_tokens": 2, "not_an_openai_field": 1})
    assert r.status_code == 200
    assert "not_an_openai_field" in caplog.text


# --- endpoints --------------------------------------------------------------------------------------------------------

def test_tokenize_detokenize_version_and_model_card(plain: Served) -> None:
    t = post(plain, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == 512
    assert post(plain, "/detokenize", {"tokens": t["tokens"]}).json() == {"prompt": PROMPT}
    chat = post(plain, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1 and chat["token_strs"] is None
    assert post(plain, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    assert httpx.get(plain.url + "/version").json()["version"]
    assert plain.oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        plain.oai.models.retrieve("nope")
    r = httpx.get(plain.url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"


def test_speculation_accepts_drafts_under_adjustments(served: Served) -> None:
    """With speculation the adjusted verify still accepts drafts (the tests above ran through the verifier)."""
    generated(served, frequency_penalty=0.5, logit_bias={"291": 2.0}, max_tokens=24)
    text = httpx.get(served.url + "/metrics").text
    accepted = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")]
    if served.speculative:
        assert accepted and accepted[0] > 0
    else:
        assert accepted == []


def test_greedy_speculation_equals_plain_under_every_adjustment() -> None:
    """Greedy tokens with a chain and a tree of drafts equal the plain engine's, for every adjustment and a grammar
    (the verifier adjusts each draft position with its own history and grammar state)."""
    from fusedserve.worker.engine.sequence import GrammarSpec, SamplingParams

    schema = json.dumps(SCHEMAS[9])
    cases = [SamplingParams(temperature=0, max_tokens=20, **{k: (tuple((int(t), b) for t, b in v.items())
                                                                 if k == "logit_bias" else v) for k, v in c.items()})
             for c in GREEDY_CASES]
    cases += [SamplingParams(temperature=0, max_tokens=40, grammar=GrammarSpec("json_schema", schema)),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=8, logit_bias=((EOS, 8.0),))]
    prompts = [PROMPT]

    def run(spec: SpeculativeConfig | None) -> list[list[int]]:
        engine = Engine(TINY, EngineConfig(num_blocks=96, max_model_len=512, dtype="float32", seed=0,
                                           speculative=spec))
        return [c.token_ids for c in engine.generate([p for p in prompts for _ in cases], cases * len(prompts))]

    plain_out = run(None)
    assert run(SpeculativeConfig(str(DRAFT), num_steps=3)) == plain_out
    assert run(SpeculativeConfig(str(DRAFT), num_steps=3, topk=2, num_draft_tokens=6)) == plain_out
    grammar_out = plain_out[len(GREEDY_CASES)]
    jsonschema.validate(json.loads(Tokenizer.from_dir(TINY).decode(grammar_out)), SCHEMAS[9])


def test_streamed_echo_and_logprobs_assemble_to_the_whole_response(served: Served) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2,
                            "echo": True}
    whole = served.oai.completions.create(**args).choices[0]
    text, tokens, lps = "", [], []
    for chunk in served.oai.completions.create(**args, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 1}
    full = served.oai.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [e for ch in served.oai.chat.completions.create(**chat, stream=True) for c in ch.choices
                if c.logprobs is not None for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in full]
