"""The engine loop of one rank: requests in, one scheduled forward per step, tokens and text out.

Each ``step`` plans a batch (``Scheduler``), runs it as a ``Step`` through the runner (the rank's
``StepExecutor``, or on a parallel engine's leader a ``LeaderExecutor`` that announces it to the
other ranks first), samples the sequences that reached their last known token (``Sampler``),
applies token-level stops, detokenizes and applies stop strings, then records the step and frees
finished sequences. The outputs of a step are streaming deltas (``RequestOutput``).

With ``EngineConfig.speculative`` the step's forward also verifies EAGLE3 drafts
(``SpecDecoder``): a decoding sequence may gain several tokens per step.

Overlapped steps (``overlap_scheduling``, on by default on one GPU; ``inflight_step.py``): a plain step
whose sampling rows can all be drawn on the device is left in flight, its tokens as placeholders; the
next ``step`` schedules and launches the following forward first (its rows take those tokens on the
device) and then reads them back and turns them into outputs, while the GPU runs. Each ``step`` then
returns the previous forward's outputs. A step with a request that needs its tokens on the host
(logprobs, a grammar, history penalties) runs as before. With speculation the same holds for chain
rounds whose requests are greedy or temperature-sampled (``SpecDecoder``'s rounds in flight): the next
``step`` launches the round after it from what the device staged (while no waiting request could be
admitted) and then reads it back.

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
from ..executor.host_copy import to_device
from ..executor.step import Step
from ..executor.step_shape import StepShape, prefill_shapes
from ..spec_decode.decoder import SpecDecoder
from .block_manager import BlockManager
from .config import EngineConfig, EngineConfigError, prefix_cache_for, resolve_max_model_len
from .detokenizer import IncrementalDetokenizer
from .forward_step import forward_step
from .grammar import GrammarCompiler
from .inflight_step import InFlightStep
from .outputs import Completion, RequestOutput
from .request_state import RequestState
from .sampler import Sampler
from .scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from .sequence import PLACEHOLDER, FinishReason, InvalidRequest, SamplingParams, Sequence, truncate_at_stop
from .stats import EngineStats
from .token_sampler import Pick, TokenSampler
from .tokenizer import Tokenizer, generation_eos_ids

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What runs the engine's forwards: this rank's executor (``local``), or a leader's runner that
    announces each forward, K/V copy and capture to the other ranks before running it on ``local``."""

    @property
    def local(self) -> StepExecutor: ...

    @property
    def single_rank(self) -> bool:
        """No other rank runs the forwards: ``run`` may take ``input_ids`` on the device."""
        ...

    def run(self, step: Step, hidden: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
            ) -> ModelOutput: ...

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
        self.sampler = Sampler(config.seed, executor.device, executor.kernels.argmax if executor.kernels else None)
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
        self.overlap = self._overlap_allowed(config)
        self._inflight: InFlightStep | None = None
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d, prefix caching %s, eos %s",
                 self.blocks.num_blocks, config.block_size, self.max_model_len,
                 "on" if self.blocks.cache.enabled else "off", sorted(self.eos_token_ids))

    def _overlap_allowed(self, config: EngineConfig) -> bool:
        one_rank = self.runner.single_rank
        if config.overlap_scheduling is None:
            return self.executor.device.type == "cuda" and one_rank
        if config.overlap_scheduling and not one_rank:
            raise EngineConfigError("overlap_scheduling runs on one rank (the ranks of a parallel engine read each "
                                    "step's tokens on the host)")
        return config.overlap_scheduling

    def _capture_graphs(self) -> None:
        """Capture the step forwards once, at start-up (every rank of the group the same shapes)."""
        config = self.config
        sizes = config.graph_batch_sizes()
        max_blocks = min(-(-(self.max_model_len + config.lookahead_tokens) // config.block_size),
                         self.blocks.num_blocks)
        prefill = config.prefill_graph_lengths(torch.device(config.device).type, self.max_model_len,
                                               self.runner.single_rank)
        if self.speculator is None:
            self.runner.capture([StepShape(b, 1) for b in sizes] + prefill_shapes(prefill), max_blocks)
        else:
            self.speculator.capture_graphs(sizes, max_blocks, prefill)
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
        n_out = sum(t != PLACEHOLDER for t in seq.output_ids) if seq else 0
        self._pending.append(RequestOutput(request_id, [], "", True, FinishReason.ABORT,
                                           len(request.prompt_ids), n_out))
        return True

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None
                or (self.speculator is not None and self.speculator.in_flight))

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        spec = self.speculator.stats() if self.speculator is not None else None
        return EngineStats(**{f.name: getattr(s, f.name) for f in fields(s)}, spec=spec)

    def collective_ledger(self) -> CollectiveLedger | None:
        """This rank's collective ledger (planned and executed collectives)."""
        return self.executor.ledger

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns the requests' new tokens and text (overlapped: those of
        the forward before it)."""
        outputs, self._pending = self._pending, []
        spec = self.speculator
        if spec is not None and spec.in_flight:  # launch the round after it unless one could be admitted, then read it
            done = spec.advance(self.scheduler, self.state_of, not self.scheduler.may_admit(), self.max_model_len)
            return outputs + self.commit_step(done.batch, done.seqs, done.picks, done.settled)
        prev, self._inflight = self._inflight, None
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs + (self._resolve(prev) if prev is not None else [])
        now = time.monotonic()
        for e in batch.seqs:
            state = self._requests[self.scheduler.get(e.seq_id).request_id]
            if state.scheduled_at is None:
                state.scheduled_at = now
        if spec is not None:
            ran = spec.step(batch, self.scheduler, self.state_of, self.overlap)
            return outputs + ([] if ran is None else self.commit_step(ran.batch, ran.seqs, ran.picks, ran.settled))
        step = forward_step(batch)
        input_ids = prev.input_ids(batch, self.executor.device) if prev is not None else None
        logits = self.runner.run(step, input_ids=input_ids).logits
        entries = [(e, s, self.state_of(s)) for e in batch.seqs for s in [self.scheduler.get(e.seq_id)]]
        first_rows = list(itertools.accumulate((e.num_logits for e in batch.seqs), initial=0))[:-1]
        if self.overlap and all(s.params.samples_on_device for e, s, _ in entries if e.num_logits):
            self._inflight = self._launch(batch, logits, entries, first_rows)
            return outputs + (self._resolve(prev) if prev is not None else [])
        if prev is not None:  # the histories this step's sampling reads become real
            outputs += self._resolve(prev)
        picks = self.tokens.pick(logits, entries, first_rows)
        chosen = [(s, p) for (e, s, _), p in zip(entries, picks) if e.num_logits and not s.is_finished]
        outputs += self.commit_step(batch, [s for s, _ in chosen], [p for _, p in chosen])
        return outputs

    def _launch(self, batch: ScheduledBatch, logits: torch.Tensor,
                entries: list[tuple[ScheduledSeq, Sequence, RequestState]], first_rows: list[int]) -> InFlightStep:
        """Draw the sampling rows' tokens on the device and leave the step in flight (placeholders)."""
        sampling = [i for i, (e, s, _) in enumerate(entries) if e.num_logits and e.context_len == s.num_tokens]
        rows = [first_rows[i] for i in sampling]  # one logits row each: no prompt logprobs here
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(rows, logits.device))
        seqs = [entries[i][1] for i in sampling]
        tokens = self.tokens.draw(logits, seqs, [entries[i][2] for i in sampling])
        inflight = InFlightStep.launch(batch, tokens, seqs)
        self.scheduler.update(batch, {}, {s.seq_id: s.num_prompt_tokens + _known_outputs(s) for _, s, _ in entries})
        return inflight

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """Read an in-flight step's tokens back (waiting for its copy only) and commit them."""
        values = step.values()
        outputs: list[RequestOutput] = []
        finished: list[tuple[Sequence, FinishReason]] = []
        now = time.monotonic()
        for seq, at, token in zip(step.seqs, step.at, values):
            if seq.is_finished:  # aborted, or stopped while this step was in flight
                continue
            seq.output_ids[at] = token
            out, _, reason = self._commit_tokens(seq, [token], at, (), (), now)
            outputs.append(out)
            if reason is not None:
                finished.append((seq, reason))
            else:
                self.scheduler.settle(seq.seq_id, seq.num_prompt_tokens + _known_outputs(seq))
        for seq, reason in finished:
            self.scheduler.finish(seq.seq_id, reason)
            del self._requests[seq.request_id]
        return outputs

    def state_of(self, seq: Sequence) -> RequestState:
        return self._requests[seq.request_id]

    def _commit_tokens(self, seq: Sequence, tokens: list[int], num_before: int, logprobs: Seq,
                       prompt_logprobs: Seq, now: float) -> tuple[RequestOutput, list[int], FinishReason | None]:
        """One sequence's new tokens after ``num_before`` outputs: stops, text, grammar, timing -> its
        output, the tokens it keeps and why it finishes (None = it goes on)."""
        state = self._requests[seq.request_id]
        kept, reason = truncate_at_stop(seq, tokens, self.eos_token_ids, self.max_model_len, num_before)
        delta = ""
        if state.detokenizer is not None and (kept or reason is not None):
            text = state.detokenizer.push(kept, finished=reason is not None)
            kept, delta = kept[: text.num_tokens_kept], text.delta
            reason = FinishReason.STOP if text.stopped else reason
        if state.grammar is not None:
            state.grammar.accept(kept)
        if kept and state.first_token_at is None:
            state.first_token_at = now
        out = RequestOutput(seq.request_id, kept, delta, reason is not None, reason, seq.num_prompt_tokens,
                            num_before + len(kept), tuple(logprobs[: len(kept)]), tuple(prompt_logprobs),
                            state.times(now) if reason is not None else None)
        return out, kept, reason

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
            out, kept, reason = self._commit_tokens(seq, pick.tokens, seq.num_output_tokens, pick.logprobs,
                                                    pick.prompt_logprobs, now)
            sampled[seq.seq_id] = kept
            if reason is not None:
                finished.append((seq, reason))
            outputs.append(out)
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
                c.logprobs += out.logprobs
                c.finish_reason = out.finish_reason
        return list(results.values())


def _known_outputs(seq: Sequence) -> int:
    """The outputs before the first placeholder (the tokens of steps still in flight come last)."""
    out = seq.output_ids
    n = len(out)
    while n and out[n - 1] == PLACEHOLDER:
        n -= 1
    return n
