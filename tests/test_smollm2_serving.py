"""A real model served as a user serves it: SmolLM2-135M-Instruct (``fusedserve fetch-model smollm2``) under
`fusedserve run` on CPU (gloo), asked with the `openai` client: the greedy text equals HF transformers'
``generate`` for a chat and a raw prompt (streamed too) at tp 1 (the model alone) and at tp 3 as
examples/04-smollm2-eagle3.yaml serves it (its 9 heads split over 3, fused all-reduce on with the reference
kernel, and its committed EAGLE3 draft: speculation keeps the greedy text, and its drafts are counted)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from tests.serve_process import Server

pytestmark = pytest.mark.ray

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
RAW = "The three primary colors are"
MAX_TOKENS = 24
EXAMPLE = ROOT / "examples/04-smollm2-eagle3.yaml"
DRAFT = ROOT / "examples/checkpoints/smollm2-eagle3"


@pytest.fixture(scope="module")
def hf_texts(smollm2: Path) -> dict[str, tuple[str, bool]]:
    """HF transformers' greedy continuations: (text without special tokens, stopped at EOS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    out = {}
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    for name, ids in (("chat", chat_ids["input_ids"]), ("raw", tok(RAW, return_tensors="pt")["input_ids"])):
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        out[name] = (tok.decode(gen, skip_special_tokens=True), gen[-1] == tok.eos_token_id)
    return out


def _manifest(tmp: Path, model: Path, tensor: int) -> Path:
    path = tmp / f"smollm2-tp{tensor}.yaml"
    path.write_text(f"""apiVersion: fusedserve.io/v1alpha1
kind: InferenceDeployment
metadata: {{name: smollm2-tp{tensor}}}
spec:
  model: {{path: {model}, dtype: float32}}
  parallelism: {{tensor: {tensor}}}
  communication: {{allReduceFusion: "on"}}
  serving: {{maxSequences: 4, maxBatchTokens: 512, kvCacheFraction: 0.2}}
""")
    return path


@pytest.fixture(scope="module", params=["tp1", "tp3-eagle3"])
def server(request: pytest.FixtureRequest, ray_address: str, smollm2: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if request.param == "tp1":
        manifest = _manifest(tmp_path_factory.mktemp("m"), smollm2, 1)
    else:  # examples/04: the model at tp 3 with the draft trained on the GPU machine, as committed
        assert (DRAFT / "model.safetensors").is_file(), "the draft trained on the GPU machine is committed"
        manifest = EXAMPLE
    s = Server(manifest, ray_address, timeout=600)
    yield s
    assert s.stop() == 0


def test_served_greedy_text_equals_hf_generate(server: Server, hf_texts: dict[str, tuple[str, bool]]) -> None:
    client = server.client()
    drafts = server.total("fusedserve_spec_decode_drafts_total")
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    text, stopped = hf_texts["chat"]
    assert chat.choices[0].message.content == text
    assert chat.choices[0].finish_reason == ("stop" if stopped else "length")
    raw = client.completions.create(model=server.model, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0)
    assert raw.choices[0].text == hf_texts["raw"][0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=RAW, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert streamed == raw.choices[0].text
    speculates = server.manifest == str(EXAMPLE)
    assert (server.total("fusedserve_spec_decode_drafts_total") > drafts) == speculates
