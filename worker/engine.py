"""The engine loop of one rank: requests in, one scheduled forward per step, tokens and text out.

Single process for now (one rank, no Ray). Each ``step`` plans a batch (``Scheduler``), runs
it (``ModelRunner``), samples the sequences that reached their last known token (``Sampler``),
applies token-level stops, detokenizes and applies stop strings, then records the step and
frees finished sequences. The outputs of a step are streaming deltas (``RequestOutput``).

With ``EngineConfig.speculative`` the step's forward also verifies EAGLE3 drafts
(``SpecDecoder``): a decoding sequence may gain several tokens per step. On a parallel engine
this loop runs on rank 0, whose runner announces each forward to the other ranks
(``distributed_runner``).

CUDA graphs (``EngineConfig.cuda_graphs``, default on CUDA, decided once here): the target's
decode steps (or, with speculation, its verify forwards) and the draft's first pass and steps
are captured at start-up at the batch sizes of ``cuda_graph_batch_sizes`` up to
``max_num_seqs`` and replayed at the next size up (``step_graphs.py``); prefill and mixed steps
run eagerly. Not for a runner passed in (a parallel engine's ranks run eagerly).

    engine = Engine("examples/checkpoints/tiny-llama", EngineConfig(num_blocks=64))
    [c] = engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..models.loader import architecture_of, load_config
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .request_output import Completion, RequestOutput
from .sampler import Sampler
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig, SchedulerStats
from .sequence import FinishReason, InvalidRequest, SamplingParams, Sequence, truncate_at_stop
from .spec_stats import SpecDecodeStats
from .speculative import SpecDecoder, SpeculativeConfig
from .step_graphs import StepShape
from .tokenizer import Tokenizer, generation_eos_ids

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Architectures whose step forwards the engine captures (dense attention, no recurrent state).
GRAPH_ARCHITECTURES = frozenset({"LlamaForCausalLM"})


class EngineConfigError(ValueError):
    """An engine configuration that cannot work; the message says which setting and why."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None = kv_memory_fraction of the free memory
    kv_memory_fraction: float = 0.5
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings, capped by the cache
    enable_chunked_prefill: bool = True
    watermark: float = 0.0  # share of blocks kept free when admitting new sequences
    num_lookahead_tokens: int = 0  # KV slots reserved per sampling sequence (speculative drafts)
    dtype: str = "float32"
    device: str = "cpu"
    skip_tokenizer: bool = False  # token ids in, token ids out (no text)
    seed: int | None = None  # random stream of unseeded requests
    speculative: SpeculativeConfig | None = None  # EAGLE3 drafting; None = off
    # CUDA graphs for decode / verify / draft steps; None = on when the device is CUDA. True off
    # CUDA runs the same padded static-shape forwards eagerly (tests).
    cuda_graphs: bool | None = None
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise EngineConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise EngineConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise EngineConfigError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.max_batch_tokens < self.max_num_seqs:
            raise EngineConfigError(f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_num_seqs "
                                    f"({self.max_num_seqs}): every running sequence needs a token per step")
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        try:
            self.scheduler_config()
        except ValueError as e:
            raise EngineConfigError(str(e)) from e

    @property
    def lookahead_tokens(self) -> int:
        """K/V slots reserved beyond each sampling sequence's last token (at least what drafting needs)."""
        spec = self.speculative.lookahead_tokens if self.speculative is not None else 0
        return max(self.num_lookahead_tokens, spec)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_batch_tokens, self.enable_chunked_prefill,
                               self.lookahead_tokens)


def use_graphs(config: EngineConfig, architecture: str) -> bool:
    """CUDA graphs for this engine: as configured, by default on CUDA for the architectures above."""
    if config.cuda_graphs is None:
        return torch.device(config.device).type == "cuda" and architecture in GRAPH_ARCHITECTURES
    if config.cuda_graphs and architecture not in GRAPH_ARCHITECTURES:
        raise EngineConfigError(f"cuda_graphs: the engine captures {', '.join(sorted(GRAPH_ARCHITECTURES))} "
                                f"only, not {architecture}")
    return config.cuda_graphs


def resolve_max_model_len(config: EngineConfig, model_max_len: int | None, blocks: BlockManager) -> int:
    """The longest sequence (prompt + output) the engine accepts: what the model allows, what one
    sequence alone can hold in the cache, and, without chunked prefill, what one step can prefill."""
    limit = (blocks.num_blocks - blocks.watermark_blocks) * blocks.block_size - config.lookahead_tokens
    if not config.enable_chunked_prefill:
        limit = min(limit, config.max_batch_tokens)
    if limit < 2:
        raise EngineConfigError(f"the KV cache ({blocks.num_blocks} blocks of {blocks.block_size}) holds no sequence")
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise EngineConfigError(
                f"max_model_len {config.max_model_len} exceeds what one sequence can use ({limit} tokens: "
                "KV cache size, watermark, lookahead, and max_batch_tokens without chunked prefill)")
        return config.max_model_len
    return min(model_max_len or limit, limit)


@dataclass(frozen=True)
class EngineStats(SchedulerStats):
    spec: SpecDecodeStats | None = None  # speculative-decoding counters; None without speculation


@dataclass
class _Request:
    seq_id: int
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None


class Engine:
    """``runner``: a model runner built by the caller (e.g. rank 0 of a parallel engine, whose
    runner announces each forward to the other ranks); default: the checkpoint on one rank."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 runner: ModelRunner | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.tokenizer = None if config.skip_tokenizer else Tokenizer.from_dir(model_dir)
        model_config = load_config(model_dir)
        graphs = runner is None and use_graphs(config, architecture_of(model_config))
        self.runner = runner or ModelRunner.load(model_dir, config.block_size, config.num_blocks,
                                                 config.kv_memory_fraction, config.max_num_seqs,
                                                 DTYPES[config.dtype], config.device, graphs=graphs)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.watermark)
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks)
        self.sampler = Sampler(config.seed, self.runner.device)
        self.speculator: SpecDecoder | None = None
        if config.speculative is not None:
            self.speculator = SpecDecoder.load(config.speculative, model_dir, self.runner, self.sampler,
                                               DTYPES[config.dtype], graphs)
        self.max_model_len = resolve_max_model_len(
            config, getattr(model_config, "max_position_embeddings", None), self.blocks)
        if graphs:
            self._capture_graphs()
        eos = set(generation_eos_ids(model_dir))
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        elif not eos and isinstance(getattr(model_config, "eos_token_id", None), int):
            eos.add(model_config.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._pending: list[RequestOutput] = []
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d, eos %s", self.blocks.num_blocks,
                 config.block_size, self.max_model_len, sorted(self.eos_token_ids))

    def _capture_graphs(self) -> None:
        """Capture the step forwards once, after the speculator set the target's aux capture."""
        config = self.config
        sizes = sorted({min(b, config.max_num_seqs) for b in config.cuda_graph_batch_sizes if b >= 1})
        max_blocks = min(-(-(self.max_model_len + config.lookahead_tokens) // config.block_size),
                         self.blocks.num_blocks)
        if self.speculator is None:
            self.runner.capture_graphs([StepShape(b, 1) for b in sizes], max_blocks)
        else:
            self.runner.capture_graphs(self.speculator.target_shapes(sizes), max_blocks)
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
        generator = Sampler.request_generator(params, self.runner.device)
        self._requests[request_id] = _Request(seq_id, prompt_ids, detok, generator)
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
        vocab = self.runner.vocab_size
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

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns the requests' new tokens and text."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        if self.speculator is not None:
            spec = self.speculator.step(batch, self.scheduler, self._generator)
            return outputs + self.commit_step(spec.batch, spec.seqs, spec.new_tokens)
        logits = self.runner.forward(batch)  # [sampling sequences, vocab]
        sampling = [s for s in batch.seqs if s.num_logits > 0]
        seqs = [self.scheduler.get(s.seq_id) for s in sampling]
        generators = [self._requests[s.request_id].generator for s in seqs]
        tokens = self.sampler(logits, [s.params for s in seqs], generators)
        outputs += self.commit_step(batch, seqs, [[t] for t in tokens])
        return outputs

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        return self._requests[seq.request_id].generator

    def commit_step(self, batch: ScheduledBatch, seqs: list[Sequence],
                    new_tokens: list[list[int]]) -> list[RequestOutput]:
        """Apply stops to each sequence's new tokens, record the step, free finished sequences.

        ``new_tokens[i]`` may hold several tokens (a speculative step's accepted drafts and bonus
        token); tokens after a stop are dropped.
        """
        outputs: list[RequestOutput] = []
        sampled: dict[int, list[int]] = {}
        finished: list[tuple[Sequence, FinishReason]] = []
        for seq, tokens in zip(seqs, new_tokens):
            kept, reason = truncate_at_stop(seq, tokens, self.eos_token_ids, self.max_model_len)
            delta = ""
            detok = self._requests[seq.request_id].detokenizer
            if detok is not None:
                text = detok.push(kept, finished=reason is not None)
                kept, delta = kept[: text.num_tokens_kept], text.delta
                reason = FinishReason.STOP if text.stopped else reason
            sampled[seq.seq_id] = kept
            if reason is not None:
                finished.append((seq, reason))
            outputs.append(RequestOutput(seq.request_id, kept, delta, reason is not None, reason,
                                         seq.num_prompt_tokens, seq.num_output_tokens + len(kept)))
        self.scheduler.update(batch, sampled)
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
