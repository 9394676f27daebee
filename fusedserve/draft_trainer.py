"""The EAGLE3 draft as a trainable module: the training-time test, its loss, and the checkpoint.

The forward is the one ``models/eagle3.py`` runs at inference (and sglang's
``LlamaForCausalLMEagle3``), written for training: per base position b of a sequence x, step 0 reads
token x[b+1] with the target's aux state at b (``fc`` of the 3 captured layers' complete input
streams), at RoPE b+1; step j >= 1 reads token x[b+1+j] with step j-1's pre-norm output at the same
base, at RoPE b+1+j — the slot layout of ``worker/spec_decode/draft_model.py``. Step j at base b
attends the step-0 keys of bases <= b and its own chain's keys of steps 1..j (what a chain sees at
inference). Step j's label is the target's distribution after x[b+1+j] over the draft vocabulary
(SpecForge's soft labels), weighted 0.8^j, masked to the response tokens.

``save_draft`` writes the ``LlamaForCausalLMEagle3`` checkpoint both our loader and sglang read:
``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t``
(draft id + d2t = target id), ``t2d``; no ``embed_tokens`` (the target's is shared, which keeps the
checkpoint small), and ``eagle_aux_hidden_state_layer_ids`` in sglang's convention (the layers
whose *output* is read: ours + 1 = the layers whose input is captured). ``load_draft`` reads one back
to continue training it (``train-draft --init``), refused unless it was made for the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .models.layers.rotary import rope_inv_freq, rope_parameters

STEP_WEIGHT = 0.8


class TrainDraftError(ValueError):
    """An input `fusedserve train-draft` cannot use (its options, a pairs file, an ``--init``
    checkpoint): the command stops before the work with the message (exit 2)."""


class DraftTrainer(nn.Module):
    """``target_config``: the target's HF config (the draft copies its width, heads and RoPE);
    ``embed``: the target's embedding [vocab, H] (frozen, not saved); ``head_init``: the target's LM
    head rows of the draft vocabulary [draft_vocab, H] (a good start for ``lm_head``)."""

    def __init__(self, target_config: Any, embed: torch.Tensor, head_init: torch.Tensor) -> None:
        super().__init__()
        c = target_config
        h = int(c.hidden_size)
        self.heads, self.kv_heads = int(c.num_attention_heads), int(c.num_key_value_heads)
        self.hd = int(getattr(c, "head_dim", None) or h // self.heads)
        self.eps = float(c.rms_norm_eps)
        self.intermediate = int(c.intermediate_size)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.embed_tokens = nn.Embedding.from_pretrained(embed.float().clone(), freeze=True)
        self.input_layernorm = nn.RMSNorm(h, eps=self.eps)
        self.hidden_norm = nn.RMSNorm(h, eps=self.eps)
        self.q_proj = nn.Linear(2 * h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=self.eps)
        self.gate_proj = nn.Linear(h, self.intermediate, bias=False)
        self.up_proj = nn.Linear(h, self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, h, bias=False)
        self.norm = nn.RMSNorm(h, eps=self.eps)
        self.lm_head = nn.Linear(h, head_init.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(head_init.float())
        theta, scaling = rope_parameters(c)
        self.rope_theta, self.rope_scaling = theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(self.hd, theta, scaling), persistent=False)
        self.inv_freq: torch.Tensor

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, heads, T, hd]; pos: [T] (HF's rotate-half layout, as models/layers/rotary.py)."""
        f = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, aux: torch.Tensor, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """aux: [B, T, 3H] (base b's aux state); tokens[j]: [B, T] (the token step j reads at base b,
        x[b+1+j]). Returns each step's draft-vocab logits [B, T, draft_vocab]."""
        B, T, _ = aux.shape
        hidden = self.fc(aux)
        pos0 = torch.arange(1, T + 1, device=aux.device)
        causal = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=aux.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        rep = self.heads // self.kv_heads
        for j, tok in enumerate(tokens):
            residual = hidden
            x = torch.cat([self.input_layernorm(self.embed_tokens(tok).to(hidden.dtype)), self.hidden_norm(hidden)], -1)
            q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
            k = self.k_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
            q, k = self.rope(q, pos0 + j), self.rope(k, pos0 + j)
            keys.append(k.repeat_interleave(rep, 1))
            values.append(v.repeat_interleave(rep, 1))
            mask = torch.cat([causal] + [eye] * j, dim=1)  # step-0 keys of bases <= b, own chain's
            att = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)
            h = self.o_proj(att.transpose(1, 2).reshape(B, T, -1)) + residual
            residual = h
            h = self.post_attention_layernorm(h)
            h = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + residual
            outs.append(self.lm_head(self.norm(h)))
            hidden = h  # the pre-norm output feeds the next step
        return outs

    def hf_state_dict(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in self.state_dict().items()}
        out = {hf_name(k): v for k, v in sd.items() if k != "embed_tokens.weight"}
        return {**out, "d2t": d2t.to(torch.long).cpu(), "t2d": t2d.to(torch.bool).cpu()}

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """The trainable weights from a checkpoint's tensors (``hf_state_dict``'s names, shapes checked by
        ``load_draft``); the frozen ``embed_tokens`` stays the target's."""
        with torch.no_grad():
            for k, v in self.state_dict().items():
                if k != "embed_tokens.weight":
                    v.copy_(weights[hf_name(k)])


def hf_name(name: str) -> str:
    """A trainer parameter's name in the ``LlamaForCausalLMEagle3`` checkpoint (``q_proj.weight`` ->
    ``midlayer.self_attn.q_proj.weight``)."""
    module = name.split(".")[0]
    if module in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        return f"midlayer.{name}"
    if module in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"midlayer.self_attn.{name}"
    if module in ("gate_proj", "up_proj", "down_proj"):
        return f"midlayer.mlp.{name}"
    return name


def shifted(x: torch.Tensor, j: int, fill: float = 0) -> torch.Tensor:
    """x[:, j:] padded at the end back to x's length: [B, T, ...] -> [B, T, ...]."""
    if j == 0:
        return x
    pad = x.new_full((x.shape[0], j, *x.shape[2:]), fill)
    return torch.cat([x[:, j:], pad], 1)


def ttt_loss(draft: DraftTrainer, aux: torch.Tensor, ids: torch.Tensor, target_logp: torch.Tensor,
             loss_mask: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float], list[int]]:
    """The training-time-test loss of one batch.

    aux: [B, L, 3H] the target's aux states; ids: [B, L] the sequences; target_logp: [B, L, V_draft]
    the target's log-probabilities over the draft vocabulary after each position; loss_mask: [B, L]
    1 where the token after the position is a response token. Base b = 0 .. L-2.
    -> (loss, per-step top-1 agreement with the target, per-step counted positions)
    """
    T = ids.shape[1] - 1
    tokens = [shifted(ids, 1 + j)[:, :T] for j in range(steps)]
    logits = draft(aux[:, :T], tokens)
    total = aux.new_zeros(())
    accs, counts = [], []
    for j, lg in enumerate(logits):
        lp = shifted(target_logp, 1 + j)[:, :T]
        m = shifted(loss_mask, 1 + j)[:, :T].float()
        n = m.sum().clamp_min(1)
        ce = -(lp.float().exp() * F.log_softmax(lg.float(), -1)).sum(-1)
        total = total + STEP_WEIGHT ** j * (ce * m).sum() / n
        agree = (lg.argmax(-1) == lp.argmax(-1)).float()
        accs.append(float((agree * m).sum() / n))
        counts.append(int(m.sum()))
    return total, accs, counts


def save_draft(out: Path, draft: DraftTrainer, d2t: torch.Tensor, t2d: torch.Tensor, target_config: Any,
               aux_input_layers: list[int]) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(draft.hf_state_dict(d2t, t2d), str(out / "model.safetensors"), metadata={"format": "pt"})
    c = target_config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "vocab_size": int(c.vocab_size), "draft_vocab_size": int(d2t.numel()),
        "hidden_size": int(c.hidden_size), "intermediate_size": draft.intermediate, "num_hidden_layers": 1,
        "num_attention_heads": draft.heads, "num_key_value_heads": draft.kv_heads, "head_dim": draft.hd,
        "hidden_act": "silu", "rms_norm_eps": draft.eps,
        "max_position_embeddings": int(getattr(c, "max_position_embeddings", 2048)),
        "rope_theta": draft.rope_theta, "rope_scaling": draft.rope_scaling if draft.rope_scaling and
        draft.rope_scaling.get("rope_type", "default") != "default" else None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "target_hidden_size": int(c.hidden_size),
        "bos_token_id": getattr(c, "bos_token_id", None), "eos_token_id": getattr(c, "eos_token_id", None),
        # sglang's convention: the layers whose output is read (it adds 1; our loader does too when the
        # first id is 1): here layers [2, N//2, N-3]'s input streams.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_input_layers]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in [out, *out.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@dataclass(frozen=True)
class DraftCheckpoint:
    """A checkpoint ``save_draft`` wrote, read back to continue training (``--init``): its tensors by
    checkpoint name (``embed_tokens`` left out: the trainer uses the target's), its draft vocabulary
    (d2t [draft_vocab] long, t2d [vocab] bool), and its path."""

    weights: dict[str, torch.Tensor]
    d2t: torch.Tensor
    t2d: torch.Tensor
    path: str


def load_draft(path: Path, target_config: Any, aux_input_layers: list[int]) -> DraftCheckpoint:
    """The draft checkpoint in ``path``, refused (``TrainDraftError``) unless made for this target:
    the same target hidden size, vocabulary and aux layers (the trainer captures ``aux_input_layers``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .models.eagle3 import aux_layers

    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise TrainDraftError(f"--init {path}: not a draft checkpoint directory (config.json and "
                              "model.safetensors expected)")
    try:
        config = json.loads((path / "config.json").read_text())
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise TrainDraftError(f"--init {path}: unreadable checkpoint: {e}") from e
    c = target_config
    layers = aux_layers(int(c.num_hidden_layers), SimpleNamespace(eagle_config=config.get("eagle_config")))
    theirs = {"target hidden size": config.get("target_hidden_size", config.get("hidden_size")),
              "vocab size": config.get("vocab_size"), "aux layers": layers}
    ours = {"target hidden size": int(c.hidden_size), "vocab size": int(c.vocab_size), "aux layers": aux_input_layers}
    wrong = [f"{k} {theirs[k]} (the target: {ours[k]})" for k in ours if theirs[k] != ours[k]]
    if wrong:
        raise TrainDraftError(f"--init {path}: a draft of another target: {', '.join(wrong)}")
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if (d2t is None or t2d is None or t2d.numel() != int(c.vocab_size)
            or not torch.equal(t2d.nonzero().flatten(), d2t.long() + torch.arange(d2t.numel()))):
        raise TrainDraftError(f"--init {path}: no consistent draft vocabulary (d2t, t2d over {int(c.vocab_size)} ids)")
    h = int(c.hidden_size)
    with torch.device("meta"):  # this target's draft, for its shapes: nothing allocated
        probe = DraftTrainer(c, torch.empty(int(c.vocab_size), h), torch.empty(d2t.numel(), h))
    shapes = {hf_name(k): list(v.shape) for k, v in probe.state_dict().items() if k != "embed_tokens.weight"}
    wrong = [f"{k} {list(tensors[k].shape) if k in tensors else 'missing'} (this target's draft: {shape})"
             for k, shape in shapes.items() if k not in tensors or list(tensors[k].shape) != shape]
    if wrong:
        raise TrainDraftError(f"--init {path}: not a draft of this target's shape: {'; '.join(wrong)}")
    return DraftCheckpoint({k: tensors[k] for k in shapes}, d2t.long(), t2d.bool(), str(path))
