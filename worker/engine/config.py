"""The frozen configuration of one engine, checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.layers.kernels import KERNEL_SETS
from ...models.quantization import QUANTIZATION_MODES
from ..spec_decode.config import SpeculativeConfig
from .block_manager import BlockManager
from .prefix_cache import NoPrefixCache, PrefixCache
from .scheduler import SchedulerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")


class EngineConfigError(ValueError):
    """An engine configuration that cannot work; the message says which setting and why."""


# The prompt lengths captured for a lone prefill by default on a CUDA device (EngineConfig.prefill_graph_tokens)
PREFILL_GRAPH_TOKENS = (32, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: kv_memory_fraction of the free memory (on CPU at most CPU_KV_BLOCKS)
    kv_memory_fraction: float = 0.5
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings, capped by the cache
    enable_chunked_prefill: bool = True
    # Full KV blocks shared by the sequences whose tokens up to them are the same (prefix_cache.py);
    # off by itself for models with recurrent (Mamba) state.
    enable_prefix_caching: bool = True
    watermark: float = 0.0  # share of blocks kept free when admitting new sequences
    num_lookahead_tokens: int = 0  # KV slots reserved per sampling sequence (speculative drafts)
    dtype: str = "float32"
    # A block-FP8 checkpoint kept in FP8 or dequantized to ``dtype`` (models/quantization.py): auto | fp8 | none.
    quantization: str = "auto"
    device: str = "cpu"
    # "auto": the checkpoint's weights; "dummy": random weights from config.json alone, drawn on the
    # device with ``seed`` (vLLM's and sglang's ``--load-format dummy``: benchmarks at real shapes).
    load_format: str = "auto"
    skip_tokenizer: bool = False  # token ids in, token ids out (no text)
    seed: int | None = None  # random stream of unseeded requests
    speculative: SpeculativeConfig | None = None  # EAGLE3 drafting; None = off
    # CUDA graphs for decode / verify / draft steps; None = on when the device is CUDA (for the
    # architectures ``executor/kernel_set.py`` names). True off CUDA runs the same padded
    # static-shape forwards eagerly (tests).
    cuda_graphs: bool | None = None
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # Prompt lengths whose prefill, one sequence alone, is captured too (with graphs): a prompt (or the chunk
    # that ends it) pads up to the next (``StepShape(1, n, last_only=True)``; with speculation the draft's pass
    # over the prompt as well); longer ones, several sequences at once and chunks that end no prompt run eagerly.
    # None = PREFILL_GRAPH_TOKENS on a CUDA device and one rank (those within max_batch_tokens and the model
    # length), none otherwise; () = every prefill eagerly. An eager prefill costs a Python launch per kernel: on the H200,
    # SmolLM2 through the engine (20 + 20 MT-bench / HumanEval prompts, each run alternated) decoded
    # 1820-1841 / 1819-1821 tok/s with them against 1461-1584 / 1514-1602 without, chain-7 2356-2432 /
    # 2337-2389 against 1831-2173 / 1763-1858 (bench/results/2026-12-05-prefill-graphs-ab-smollm2-h200.json).
    prefill_graph_tokens: tuple[int, ...] | None = None
    # The kernel set: "auto" = the device's choice (executor/kernel_set.py: the fast set on a GPU, the
    # references on CPU); or a name of models/layers/kernels.py (tests and benchmarks compare sets).
    kernels: str = "auto"
    # Overlapped steps (``inflight_step.py``): the next plain step is scheduled and launched before this
    # one's tokens are read back; with speculation the next chain round before this one's verdict
    # (``SpecDecoder.advance``). None = on with a CUDA device and one rank; True also off CUDA (tests: the
    # same tokens, one step later); False = every step reads its tokens back.
    overlap_scheduling: bool | None = None

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
        if self.quantization not in QUANTIZATION_MODES:
            raise EngineConfigError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, "
                                    f"not {self.quantization!r}")
        if self.kernels != "auto" and self.kernels not in KERNEL_SETS:
            raise EngineConfigError(f"kernels must be auto or one of {', '.join(KERNEL_SETS)}, not {self.kernels!r}")
        lengths = self.prefill_graph_tokens or ()
        bad = [n for n in lengths if not 2 <= n <= self.max_batch_tokens]
        if bad or len(set(lengths)) != len(lengths):
            raise EngineConfigError(f"prefill_graph_tokens must be distinct prompt lengths in 2..max_batch_tokens "
                                    f"({self.max_batch_tokens}), got {list(lengths)}")
        if self.load_format not in LOAD_FORMATS:
            raise EngineConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, not {self.load_format!r}")
        try:
            self.scheduler_config()
        except ValueError as e:
            raise EngineConfigError(str(e)) from e

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def lookahead_tokens(self) -> int:
        """K/V slots reserved beyond each sampling sequence's last token (at least what drafting needs)."""
        spec = self.speculative.lookahead_tokens if self.speculative is not None else 0
        return max(self.num_lookahead_tokens, spec)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_batch_tokens, self.enable_chunked_prefill,
                               self.lookahead_tokens)

    def graph_batch_sizes(self) -> list[int]:
        """The batch sizes CUDA graphs are captured at (at most ``max_num_seqs``)."""
        return sorted({min(b, self.max_num_seqs) for b in self.cuda_graph_batch_sizes if b >= 1})

    def prefill_graph_lengths(self, device_type: str, max_model_len: int, one_rank: bool) -> list[int]:
        """The prompt lengths a lone prefill is captured at: those given, or by default (None) on a CUDA device
        and one rank PREFILL_GRAPH_TOKENS within max_batch_tokens and ``max_model_len`` (several ranks have not
        run them on GPUs yet: given explicitly they do)."""
        if self.prefill_graph_tokens is not None:
            return sorted(self.prefill_graph_tokens)
        if device_type != "cuda" or not one_rank:
            return []
        return [n for n in PREFILL_GRAPH_TOKENS if n <= min(self.max_batch_tokens, max_model_len)]


def prefix_cache_for(config: EngineConfig, recurrent: bool) -> PrefixCache:
    """The engine's prefix cache: none when off or when the model keeps recurrent state (a block's
    K/V alone does not restore it); with a draft model, a block's key covers the token after it
    (the draft's K/V in a block's last slot is computed from it)."""
    if not config.enable_prefix_caching or recurrent:
        return NoPrefixCache(config.block_size)
    return PrefixCache(config.block_size, lookahead=1 if config.speculative is not None else 0)


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
