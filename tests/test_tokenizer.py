"""Tokenizer from a checkpoint directory, chat template, incremental detokenisation, stop strings."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from fusedserve.tiny_tokenizer import make_tiny_tokenizer
from fusedserve.worker.engine.detokenizer import IncrementalDetokenizer
from fusedserve.worker.engine.tokenizer import Tokenizer, TokenizerError

TEXT = "héllo wörld 日本語, the quick fox END! print(i)"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_loads_from_checkpoint_dir_and_round_trips(tok: Tokenizer) -> None:
    assert tok.vocab_size == 300
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    # Characters outside ASCII span several byte-level tokens: a lone token decodes to U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_eos_ids_join_tokenizer_and_generation_config(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == {1, 2}
    assert tok.special_ids == {0, 1, 2}


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s><|system|>be brief\n<|user|>hi\n<|assistant|>"
    ids = tok.encode_chat(messages)
    assert ids[0] == 0 and ids.count(0) == 1  # BOS once, from the template
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("hi\n")


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_missing_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    t = Tokenizer.from_dir(make_tiny_tokenizer(tmp_path, chat_template=None))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="no chat_template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), chunk: int = 1,
           prompt: str = "say:") -> tuple[list[str], IncrementalDetokenizer, int]:
    """Push ``ids`` ``chunk`` at a time; returns the deltas, the detokenizer and the tokens kept."""
    d = IncrementalDetokenizer(tok, tok.encode(prompt), stop)
    deltas: list[str] = []
    kept = 0
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        step = d.push(part, finished=i + chunk >= len(ids))
        deltas.append(step.delta)
        kept += step.num_tokens_kept
        if step.stopped:
            break
    return deltas, d, kept


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenisation_matches_full_decode(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(TEXT)
    deltas, d, kept = stream(tok, ids, chunk=chunk)
    assert "".join(deltas) == d.text == tok.decode(ids) == TEXT
    assert kept == len(ids)
    assert not any("\ufffd" in x for x in deltas), "a partial character was streamed"


def test_unfinished_character_is_flushed_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("ab日")[:-1]  # cut inside the character
    deltas, d, _ = stream(tok, ids)
    assert "".join(deltas) == d.text == tok.decode(ids)
    assert d.text.startswith("ab") and d.text.endswith("\ufffd")


def test_special_tokens_skipped_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("hi") + [1]
    _, d, _ = stream(tok, ids)
    assert d.text == "hi"


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    pieces = [tok.decode([i]) for i in ids]
    assert "END" not in pieces, "the stop string must span several tokens for this test"
    deltas, d, kept = stream(tok, ids, stop=("END",))
    assert d.stopped and d.text == TEXT[: TEXT.index("END")]
    assert "".join(deltas) == d.text
    assert not any("E" in x for x in deltas[:-1] if x)  # never streamed a piece of the stop string
    # The sequence ends with the token that completed "END".
    assert tok.decode(ids[:kept]).endswith("END") and not tok.decode(ids[:kept - 1]).endswith("END")


def test_stop_string_inside_a_multi_token_push(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    _, d1, kept1 = stream(tok, ids, stop=("fox", "日本"), chunk=1)
    _, d5, kept5 = stream(tok, ids, stop=("fox", "日本"), chunk=5)
    assert d1.text == d5.text == TEXT[: TEXT.index("日本")]
    assert kept1 == kept5


def test_held_back_text_is_released_when_no_stop_follows(tok: Tokenizer) -> None:
    ids = tok.encode("an ENDLESS EN")
    d = IncrementalDetokenizer(tok, [5], ("END!",))
    emitted = ""
    for t in ids[:-1]:
        emitted += d.push([t]).delta
        assert emitted == d.text[: max(len(d.text) - 3, 0)]  # len("END!") - 1 characters held back
    emitted += d.push(ids[-1:], finished=True).delta
    assert not d.stopped and emitted == d.text == "an ENDLESS EN"


def test_push_after_stop_is_an_error(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, [5], ("o",))
    assert d.push(tok.encode("foo")).stopped
    with pytest.raises(RuntimeError):
        d.push([5])


def test_fallback_reads_the_chat_template_from_chat_template_jinja(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5 saves the template to chat_template.jinja. When AutoTokenizer cannot load a
    checkpoint (e.g. transformers 4 and a transformers-5 tokenizer_config.json naming the class
    "TokenizersBackend"), the loader falls back to tokenizer.json and must find the template there too."""
    import transformers

    d = make_tiny_tokenizer(tmp_path, chat_template=None)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                                           "{% if add_generation_prompt %}[assistant]{% endif %}")

    def unusable(*args: object, **kwargs: object) -> None:
        raise ValueError("Tokenizer class TokenizersBackend does not exist or is not currently imported.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unusable)
    with caplog.at_level("WARNING"):
        t = Tokenizer.from_dir(d)
    assert "loading tokenizer.json directly" in caplog.text  # the fallback path ran
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi[assistant]"
    assert t.decode(t.encode(TEXT)) == TEXT


def _random_stream(tok: Tokenizer, n: int, seed: int) -> list[int]:
    """Token ids of real text in several scripts, cut into words and shuffled (multi-byte characters spread over
    several byte-level tokens, and cut between pushes)."""
    import random

    words = (TEXT + " naïve café 🙂 ünïcödé Ελληνικά def f(x):\n    return x ** 2  # ok").split(" ")
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" " + rng.choice(words), add_special_tokens=False)
    return ids[:n]


def _pushes(tok: Tokenizer, ids: list[int], sizes: list[int], finished_last: bool = True) -> list[str]:
    d = IncrementalDetokenizer(tok, tok.encode("say:"))
    deltas, at = [], 0
    for k in sizes:
        part = ids[at:at + k]
        at += k
        deltas.append(d.push(part, finished=finished_last and at >= len(ids)).delta)
    assert at >= len(ids)
    return deltas


@pytest.mark.parametrize("seed", range(4))
def test_a_rounds_tokens_in_one_push_stream_what_token_by_token_pushes_stream(tok: Tokenizer, seed: int) -> None:
    """A speculative round's accepted tokens come as one push (one pair of decodes): each push's delta equals
    the text the same tokens streamed one push each, cut characters included."""
    import random

    ids = _random_stream(tok, 200, seed)
    rng = random.Random(seed)
    sizes: list[int] = []
    while sum(sizes) < len(ids):
        sizes.append(rng.randint(1, 8))
    by_round = _pushes(tok, ids, sizes)
    by_token = _pushes(tok, ids, [1] * len(ids))
    ends = list(itertools.accumulate(sizes))
    starts = [0, *ends[:-1]]
    assert by_round == ["".join(by_token[a:b]) for a, b in zip(starts, ends)]
    assert "".join(by_round) == tok.decode(ids)


def test_the_fast_tokenizers_own_decode_gives_transformers_text(tok: Tokenizer, smollm2: Path) -> None:
    """``Tokenizer.decode`` takes the fast tokenizer's own decode where transformers adds nothing after it: the
    same text for every window of a stream (the tiny test tokenizer and SmolLM2's byte-level BPE)."""
    from fusedserve.worker.engine.tokenizer import _direct_decode

    for t in (tok, Tokenizer.from_dir(smollm2)):
        assert _direct_decode(t.hf) is not None
        ids = _random_stream(t, 120, 7) + sorted(t.special_ids)[:2]
        for skip in (True, False):
            for i in range(0, len(ids), 3):
                for j in range(i, min(len(ids), i + 9)):
                    assert t.decode(ids[i:j], skip_special_tokens=skip) == t.hf.decode(ids[i:j],
                                                                                          skip_special_tokens=skip)


def test_a_tokenizer_whose_decode_cleans_up_spaces_keeps_transformers_decode(tok: Tokenizer) -> None:
    """Where transformers' decode changes the fast tokenizer's text (its clean-up of tokenization spaces, applied
    or skipped by tokenizer kind and version), ``Tokenizer`` keeps transformers' decode."""
    from fusedserve.worker.engine.tokenizer import _direct_decode

    class CleaningUp:  # transformers' decode with the clean-up on, over the tiny tokenizer
        backend_tokenizer = tok.hf.backend_tokenizer

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return list(tok.hf.encode(text, add_special_tokens=add_special_tokens))

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
            return text.replace(" .", ".").replace(" ,", ",").replace(" n't", "n't")

    assert _direct_decode(tok.hf) is not None
    assert _direct_decode(CleaningUp()) is None


def test_a_tokenizer_survives_pickling_with_its_decode(tok: Tokenizer) -> None:
    """A Tokenizer goes to other processes whole (its decode a bound method, not a closure)."""
    import pickle

    again = pickle.loads(pickle.dumps(tok))
    ids = tok.encode(TEXT)
    assert again.decode(ids) == tok.decode(ids) == TEXT
