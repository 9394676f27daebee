"""The engine loop of one rank: requests in, one scheduled forward per step, tokens and text out.

Each ``step`` plans a batch (``Scheduler``), runs it as a ``Step`` through the runner (the rank's
``StepExecutor``, or on a parallel engine's leader a ``LeaderExecutor`` that announces it to the
other ranks first), samples the sequences that reached their last known token (``Sampler``),
applies token-level stops, detokenizes and applies stop strings, then records the step and frees
finished sequences. The outputs of a step are streaming deltas (``RequestOutput``).

With ``EngineConfig.speculative`` the step's forward also verifies EAGLE3 drafts
(``SpecDecoder``): a decoding sequence may gain several tokens per step.

CUDA graphs (decided once, when the rank is built: ``executor/kernel_set.py``): the target's
decode steps (or, with speculation, its verify forwards) and the draft's first pass and steps
are captured at start-up at the batch sizes of ``cuda_graph_batch_sizes`` up to ``max_num_seqs``
and replayed at the next size up (``executor/step_graphs.py``), on one rank or many (the leader
announces the capture, so every rank captures the same shapes); prefill and mixed steps run eagerly.

    engine = Engine("examples/checkpoints/tiny-llama", EngineConfig(num_blocks=64))
    [c] = engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import fields
from pathlib import Path
from typing import Protocol

import torch

from ...models.interface import ModelOutput
from ...models.loader import load_config
from ...models.parallel.ledger import CollectiveLedger
from ..executor.executor import StepExecutor
from ..executor.step import Step
from ..executor.step_shape import StepShape
from ..spec_decode.decoder import SpecDecoder
from .block_manager import BlockManager
from .config import EngineConfig, prefix_cache_for, resolve_max_model_len
from .detokenizer import IncrementalDetokenizer
from .forward_step import forward_step
from .grammar import GrammarCompiler
from .outputs import Completion, RequestOutput
from .request_state import RequestState
from .sampler import Sampler
from .scheduler import ScheduledBatch, Scheduler
from .sequence import FinishReason, InvalidRequest, SamplingParams, Sequence, truncate_at_stop
from .stats import EngineStats
from .token_sampler import Pick, TokenSampler
from .tokenizer import Tokenizer, generation_eos_ids

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What runs the engine's forwards: this rank's executor (``local``), or a leader's runner that
    announces each forward, K/V copy and capture to the other ranks before running it on ``local``."""

    @property
    def local(self) -> StepExecutor: ...

    def run(self, step: Step, hidden: torch.Tensor | None = None) -> ModelOutput: ...

    def copy_kv(self, src: list[int], dst: list[int]) -> None: ...

    def capture(self, shapes: Seq[StepShape], max_blocks: int) -> None: ...


class Engine:
    """``runner``: what runs the forwards, built by the caller (e.g. a parallel engine's leader);
    default: the checkpoint on one rank (``parallel/rank.py``'s ``build_rank``)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 runner: Runner | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.tokenizer = None if config.skip_tokenizer else Tokenizer.from_dir(model_dir)
        model_config = load_config(model_dir)
        if runner is None:
            from ..parallel.rank import build_rank

            runner = build_rank(model_dir, config).executor
        self.runner: Runner = runner
        self.executor = executor = runner.local
        self.vocab_size = int(model_config.vocab_size)
        recurrent = executor.state_cache is not None
        if config.enable_prefix_caching and recurrent:
            log.info("prefix caching is off: the model keeps recurrent (Mamba) state, which cached KV blocks "
                     "cannot restore")
        self.blocks = BlockManager(executor.num_blocks, config.block_size, config.watermark,
                                   prefix_cache_for(config, recurrent))
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks)
        eos = set(generation_eos_ids(model_dir))
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        elif not eos and isinstance(getattr(model_config, "eos_token_id", None), int):
            eos.add(model_config.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.sampler = Sampler(config.seed, executor.device)
        self.tokens = TokenSampler(self.sampler, self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.speculator: SpecDecoder | None = None
        if config.speculative is not None:
            self.speculator = SpecDecoder.load(config.speculative, model_dir, model_config, runner, self.tokens,
                                               config.torch_dtype)
        self.max_model_len = resolve_max_model_len(
            config, getattr(model_config, "max_position_embeddings", None), self.blocks)
        if executor.graph_ready:
            self._capture_graphs()
        self._requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self._pending: list[RequestOutput] = []
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d, prefix caching %s, eos %s",
                 self.blocks.num_blocks, config.block_size, self.max_model_len,
                 "on" if self.blocks.cache.enabled else "off", sorted(self.eos_token_ids))

    def _capture_graphs(self) -> None:
        """Capture the step forwards once, at start-up (every rank of the group the same shapes)."""
        config = self.config
        sizes = config.graph_batch_sizes()
        max_blocks = min(-(-(self.max_model_len + config.lookahead_tokens) // config.block_size),
                         self.blocks.num_blocks)
        if self.speculator is None:
            self.runner.capture([StepShape(b, 1) for b in sizes], max_blocks)
        else:
            self.runner.capture(self.speculator.target_shapes(sizes), max_blocks)
            self.speculator.capture_graphs(sizes, max_blocks)
        log.info("step graphs at batch sizes %s (%d blocks per sequence)%s", sizes, max_blocks,
                 "" if torch.device(config.device).type == "cuda" else ", run eagerly off CUDA")

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id. Raises ``InvalidRequest``."""
        params = params or SamplingParams()
        seq_id = next(self._seq_ids)
        request_id = request_id if request_id is not None else f"req-{seq_id}"
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt of {len(prompt_ids)} tokens leaves no room to generate "
                                 f"(max_model_len {self.max_model_len})")
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens)
        elif params.stop:
            raise InvalidRequest("stop strings need a tokenizer (the engine runs with skip_tokenizer)")
        bad_bias = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise InvalidRequest(f"logit_bias token ids outside the vocabulary [0, {self.vocab_size}): {bad_bias[:5]}")
        grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        generator = Sampler.request_generator(params, self.executor.device)
        self._requests[request_id] = RequestState(seq_id, prompt_ids, detok, generator, grammar,
                                                  queued_at=time.monotonic())
        self.scheduler.add(Sequence(seq_id, request_id, list(prompt_ids), params))
        return request_id

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("text prompts need a tokenizer (the engine runs with skip_tokenizer)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("the prompt has no tokens")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return ids

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its final output (reason "abort") comes with the next step. False if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        seq = self.scheduler.finish(request.seq_id, FinishReason.ABORT)
        n_out = seq.num_output_tokens if seq else 0
        self._pending.append(RequestOutput(request_id, [], "", True, FinishReason.ABORT,
                                           len(request.prompt_ids), n_out))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        spec = self.speculator.stats() if self.speculator is not None else None
        return EngineStats(**{f.name: getattr(s, f.name) for f in fields(s)}, spec=spec)

    def collective_ledger(self) -> CollectiveLedger | None:
        """This rank's collective ledger (planned and executed collectives)."""
        return self.executor.ledger

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns the requests' new tokens and text."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        now = time.monotonic()
        for e in batch.seqs:
            state = self._requests[self.scheduler.get(e.seq_id).request_id]
            if state.scheduled_at is None:
                state.scheduled_at = now
        if self.speculator is not None:
            spec = self.speculator.step(batch, self.scheduler, self.state_of)
            return outputs + self.commit_step(spec.batch, spec.seqs, spec.picks, spec.settled)
        logits = self.runner.run(forward_step(batch)).logits  # [sum(num_logits), vocab]
        entries = [(e, s, self.state_of(s)) for e in batch.seqs for s in [self.scheduler.get(e.seq_id)]]
        first_rows = list(itertools.accumulate((e.num_logits for e in batch.seqs), initial=0))[:-1]
        picks = self.tokens.pick(logits, entries, first_rows)
        chosen = [(s, p) for (e, s, _), p in zip(entries, picks) if e.num_logits]
        outputs += self.commit_step(batch, [s for s, _ in chosen], [p for _, p in chosen])
        return outputs

    def state_of(self, seq: Sequence) -> RequestState:
        return self._requests[seq.request_id]

    def commit_step(self, batch: ScheduledBatch, seqs: list[Sequence], picks: list[Pick],
                    settled: Mapping[int, int] | None = None) -> list[RequestOutput]:
        """Apply stops to each sequence's new tokens, record the step, free finished sequences.

        ``picks[i].tokens`` may hold several tokens (a speculative step's accepted drafts and bonus
        token), or none (a prompt chunk that only scored prompt tokens); tokens after a stop are
        dropped, and so are their logprobs. A grammar's matcher advances over the kept tokens.
        ``settled``: the tokens per sequence whose K/V is final in the draft's cache too
        (``Scheduler.update``).
        """
        outputs: list[RequestOutput] = []
        sampled: dict[int, list[int]] = {}
        finished: list[tuple[Sequence, FinishReason]] = []
        now = time.monotonic()
        for seq, pick in zip(seqs, picks):
            state = self._requests[seq.request_id]
            kept, reason = truncate_at_stop(seq, pick.tokens, self.eos_token_ids, self.max_model_len)
            delta = ""
            if state.detokenizer is not None and (kept or reason is not None):
                text = state.detokenizer.push(kept, finished=reason is not None)
                kept, delta = kept[: text.num_tokens_kept], text.delta
                reason = FinishReason.STOP if text.stopped else reason
            if state.grammar is not None:
                state.grammar.accept(kept)
            sampled[seq.seq_id] = kept
            if kept and state.first_token_at is None:
                state.first_token_at = now
            if reason is not None:
                finished.append((seq, reason))
            outputs.append(RequestOutput(seq.request_id, kept, delta, reason is not None, reason,
                                         seq.num_prompt_tokens, seq.num_output_tokens + len(kept),
                                         tuple(pick.logprobs[: len(kept)]), tuple(pick.prompt_logprobs),
                                         state.times(now) if reason is not None else None))
        self.scheduler.update(batch, sampled, settled)
        for seq, reason in finished:
            self.scheduler.finish(seq.seq_id, reason)
            del self._requests[seq.request_id]
        return outputs

    def generate(self, prompts: Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts to completion (offline use, on an idle engine); results in prompt order."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drive add_request/step yourself instead")
        per_prompt = list(params) if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
        results: dict[str, Completion] = {}
        try:
            for prompt, p in zip(prompts, per_prompt):
                rid = self.add_request(prompt, p)
                results[rid] = Completion(rid, list(self._requests[rid].prompt_ids), [], "", None)
        except InvalidRequest:
            for rid in results:  # leave the engine idle, as it was
                self.abort(rid)
            self._pending.clear()
            raise
        while self.has_unfinished():
            for out in self.step():
                c = results[out.request_id]
                c.token_ids += out.new_token_ids
                c.text += out.text_delta
                c.finish_reason = out.finish_reason
        return list(results.values())
