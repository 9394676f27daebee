"""Tiny random HuggingFace checkpoints (fp32) for tests, demos and `fusedserve verify`.

Made with transformers' own classes and ``save_pretrained``, so the oracle is nobody's code
but HuggingFace's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=250,  # deliberately not a multiple of 64: exercises vocab padding
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def make_tiny_llama(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**LLAMA_DEFAULTS, **overrides})
    model = LlamaForCausalLM(config).float()
    # HF initialises norms to ones; random weights make a wrong norm visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 250,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,  # != qk_head_dim: K and V cache dims differ
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,  # < n_group: group selection matters
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def make_tiny_deepseek_v3(out_dir: str | Path, seed: int = 0, save_original_format: bool = True,
                          **overrides: Any) -> Path:
    """Tiny random DeepseekV3ForCausalLM (MLA, grouped sigmoid routing, shared expert).

    ``e_score_correction_bias`` and the router are randomised (HF inits the bias to zeros,
    which would hide routing bugs), norms too. ``save_original_format=False`` writes
    transformers' fused expert tensors instead of per-expert ones.
    """
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**DEEPSEEK_V3_DEFAULTS, **overrides})
    model = DeepseekV3ForCausalLM(config)  # fp32: torch's default dtype
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # spread router logits so choices are clear-cut
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    out = Path(out_dir)
    extra: dict[str, Any] = {} if save_original_format else {"save_original_format": False}  # transformers >= 5
    model.save_pretrained(str(out), safe_serialization=True, **extra)
    return out


def make_tiny_deepseek_v3_fp8(out_dir: str | Path, block: tuple[int, int] = (8, 8), seed: int = 0,
                              save_original_format: bool = True, **overrides: Any) -> Path:
    """Tiny random DeepseekV3ForCausalLM in the release's block-FP8 format: ``make_tiny_deepseek_v3``,
    then every attention projection, dense MLP and (shared) expert weight quantized to e4m3 with
    ``weight_scale_inv`` (one scale per ``block`` = [bn, bk]; fused expert tensors: ``<name>_scale_inv``),
    and config.json's ``quantization_config`` as DeepSeek-V3 ships it (block scaled down for the tiny
    shapes). Embeddings, LM head, norms, router and correction bias stay fp32."""
    import json

    from safetensors.torch import load_file, save_file

    from fusedserve.models.layers.fp8_block import BlockFP8, quantize_weight

    out = make_tiny_deepseek_v3(out_dir, seed=seed, save_original_format=save_original_format, **overrides)
    fmt = BlockFP8(*block)
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in list(tensors):
            if not is_fp8_quantized_name(name):
                continue
            q, scale = quantize_weight(tensors[name], fmt)
            tensors[name] = q
            tensors[name + "_scale_inv"] = scale  # ".weight_scale_inv"; fused experts: "<name>_scale_inv"
        save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def is_fp8_quantized_name(name: str) -> bool:
    """The tensors DeepSeek-V3's FP8 release quantizes: attention projections, dense MLPs, shared and
    routed experts (``...weight`` 2-D, or fused ``experts.gate_up_proj`` / ``experts.down_proj``)."""
    if ".layers." not in f".{name}" or "layernorm" in name or name.endswith(("mlp.gate.weight", "_bias")):
        return False
    return name.endswith(("_proj.weight", "_mqa.weight", "experts.gate_up_proj", "experts.down_proj"))


NEMOTRON_H_DEFAULTS: dict[str, Any] = dict(
    vocab_size=250,
    hidden_size=64,
    hybrid_override_pattern="M*-EME",  # two Mamba, attention, dense MLP, two MoE layers
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=4,  # divides tp <= 4: the gated norm's groups stay on one rank
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=8,  # prompts of ~20 tokens cross chunks
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    moe_latent_size=32,
    n_group=4,
    topk_group=2,  # < n_group: group selection matters
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    layer_norm_epsilon=1e-5,
    initializer_range=0.05,
    tie_word_embeddings=False,
)


def make_tiny_nemotron_h(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny random NemotronHForCausalLM (Mamba2, NoPE attention, relu² MLP, latent MoE).

    Norms (the Mamba gated norms too), A_log, D, the router and ``e_score_correction_bias`` are
    randomised: HF's initial values (ones, log(1..heads), zeros) would hide slicing and
    routing bugs.
    """
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**{**NEMOTRON_H_DEFAULTS, **overrides})
    model = NemotronHForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0)))
            elif name.endswith("mixer.gate.weight"):
                p.normal_(0.0, 0.5)  # spread router logits so choices are clear-cut
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


EAGLE3_DRAFT_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def make_tiny_eagle3_draft(out_dir: str | Path, target_dir: str | Path, seed: int = 0,
                           draft_vocab_size: int | None = None, own_embedding: bool = True,
                           **overrides: Any) -> Path:
    """Tiny random EAGLE3 draft (`LlamaForCausalLMEagle3`, the HF layout SpecForge writes) for the
    target checkpoint at ``target_dir``: ``fc`` [H, 3*H_target], ``midlayer.*`` (q/k/v take 2H),
    ``norm``, ``lm_head`` and ``d2t``/``t2d`` over a draft vocabulary of ``draft_vocab_size`` target
    ids (a random hot subset; default: all), ``embed_tokens`` unless ``own_embedding=False`` (then
    the target's is shared). Aux layers: the default [2, N//2, N-3].
    """
    import json

    import torch
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = {**EAGLE3_DRAFT_DEFAULTS, **overrides}
    vocab, target_hidden = int(target["vocab_size"]), int(target["hidden_size"])
    draft_vocab = draft_vocab_size or vocab
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or h // heads)
    g = torch.Generator().manual_seed(seed)

    def dense(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    def norm(size: int) -> torch.Tensor:
        return torch.rand(size, generator=g) + 0.5

    hot = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": dense(h, 3 * target_hidden),
        "midlayer.input_layernorm.weight": norm(h),
        "midlayer.hidden_norm.weight": norm(h),
        "midlayer.post_attention_layernorm.weight": norm(h),
        "midlayer.self_attn.q_proj.weight": dense(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": dense(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": dense(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": dense(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": dense(inter, h),
        "midlayer.mlp.up_proj.weight": dense(inter, h),
        "midlayer.mlp.down_proj.weight": dense(h, inter),
        "norm.weight": norm(h),
        "lm_head.weight": dense(draft_vocab, h),
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, h, generator=g)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "num_hidden_layers": 1, "tie_word_embeddings": False,
        "max_position_embeddings": int(target.get("max_position_embeddings", 256)),
        "target_hidden_size": target_hidden, "torch_dtype": "float32", **cfg,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
