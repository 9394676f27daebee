"""Train the tiny target + EAGLE3 draft pair shipped under examples/checkpoints/ (offline, reproducible).

    python bench/train_tiny_pair.py --out examples/checkpoints [--device cuda] [--seed 0]

1. Corpus: the Python files of this interpreter's standard library; files whose path's CRC32
   is 0 mod 10 are held out for evaluation (``heldout_files``).
2. Tokenizer: byte-level BPE (the `tokenizers` library), 1024 ids, saved as tokenizer.json +
   tokenizer_config.json with a chat template.
3. Target: a Llama (8 layers, hidden 128, GQA 4/2 heads, tied embeddings), next-token loss on
   random 256-token windows of the training files.
4. Draft: EAGLE3 (`LlamaForCausalLMEagle3`) on the target's aux states (the inputs of layers
   [2, N//2, N-3]), trained with a training-time test: ``--ttt-steps`` unrolled draft steps,
   each later step feeding the draft its own previous output, attending to the first step's
   keys of earlier positions plus its own chain (the mask the chain sees at inference), with
   the target's greedy next tokens as labels.
Everything is seeded; on one machine and interpreter a rerun gives the same files (GPU
kernels may differ in the last bits across machines).
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|endoftext|>\n"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TARGET = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=0)
DRAFT = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    held = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0]
    train = [p for p in files if p not in set(held)]
    return train, held


def read(files: list[Path]) -> list[str]:
    out = []
    for p in files:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], out: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def token_stream(tok, texts: list[str]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t) + [0]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def train_target(stream: torch.Tensor, out: Path, steps: int, device: str, seed: int, log: dict):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TARGET)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3)
        x = windows(stream, 64, 257, g).to(device)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            logits = model(x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"target step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    log["target_final_train_loss"] = round(loss.item(), 4)
    model.eval()
    # Stored in bf16 to keep the example small; loaders upcast as asked (tests run fp32).
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    return model.float()


class DraftTrainer(nn.Module):
    """The EAGLE3 draft with a differentiable, training-time-test forward; names match the checkpoint."""

    def __init__(self, target_hidden: int, embed: torch.Tensor) -> None:
        super().__init__()
        h = DRAFT["hidden_size"]
        self.heads, self.kv_heads = DRAFT["num_attention_heads"], DRAFT["num_key_value_heads"]
        self.hd = h // self.heads
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.embed_tokens = nn.Embedding.from_pretrained(embed.clone(), freeze=True)
        self.input_layernorm = nn.RMSNorm(h, eps=DRAFT["rms_norm_eps"])
        self.hidden_norm = nn.RMSNorm(h, eps=DRAFT["rms_norm_eps"])
        self.q_proj = nn.Linear(2 * h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=DRAFT["rms_norm_eps"])
        self.gate_proj = nn.Linear(h, DRAFT["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(h, DRAFT["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(DRAFT["intermediate_size"], h, bias=False)
        self.norm = nn.RMSNorm(h, eps=DRAFT["rms_norm_eps"])
        self.lm_head = nn.Linear(h, VOCAB, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [B, heads, T, hd]; pos: [T]
        f = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos(), emb.sin()
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, aux: torch.Tensor, tokens: list[torch.Tensor], ttt: int) -> list[torch.Tensor]:
        """aux: [B, T, 3H]; tokens[j]: [B, T] input ids of step j. Returns logits per step."""
        B, T, _ = aux.shape
        hidden = self.fc(aux)
        pos0 = torch.arange(1, T + 1, device=aux.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for j in range(ttt):
            residual = hidden
            x = torch.cat([self.input_layernorm(self.embed_tokens(tokens[j])), self.hidden_norm(hidden)], -1)
            q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
            k = self.k_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
            q, k = self.rope(q, pos0 + j), self.rope(k, pos0 + j)
            k = k.repeat_interleave(self.heads // self.kv_heads, 1)
            v = v.repeat_interleave(self.heads // self.kv_heads, 1)
            keys.append(k)
            values.append(v)
            # step j at base t sees step-0 keys of bases <= t and steps 1..j at base t itself
            causal = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()
            eye = torch.eye(T, dtype=torch.bool, device=aux.device)
            mask = torch.cat([causal] + [eye] * j, dim=1)
            att = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)
            h = self.o_proj(att.transpose(1, 2).reshape(B, T, -1)) + residual
            residual = h
            h = self.post_attention_layernorm(h)
            h = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + residual
            outs.append(self.lm_head(self.norm(h)))
            hidden = h  # the pre-norm output feeds the next step
        return outs

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in self.state_dict().items()}
        out = {"fc.weight": sd["fc.weight"], "embed_tokens.weight": sd["embed_tokens.weight"],
               "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
               "d2t": torch.zeros(VOCAB, dtype=torch.long), "t2d": torch.ones(VOCAB, dtype=torch.bool)}
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[f"midlayer.{name}.weight"] = sd[f"{name}.weight"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"midlayer.self_attn.{name}.weight"] = sd[f"{name}.weight"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"midlayer.mlp.{name}.weight"] = sd[f"{name}.weight"]
        return out


def target_features(target, x: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = target(x, output_hidden_states=True)
    # hidden_states[i] is the input of layer i (the embedding output for i = 0)
    aux = torch.cat([out.hidden_states[i] for i in layers], -1)
    return aux.float(), out.logits.argmax(-1)


def train_draft(target, stream: torch.Tensor, out: Path, steps: int, ttt: int, device: str, seed: int,
                log: dict) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    n = TARGET["num_hidden_layers"]
    layers = [2, n // 2, n - 3]
    torch.manual_seed(seed + 1)
    draft = DraftTrainer(TARGET["hidden_size"], target.get_input_embeddings().weight.detach().float()).to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed + 1)
    t0 = time.time()
    T = 256
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3)
        x = windows(stream, 32, T + ttt + 1, g).to(device)
        aux, greedy = target_features(target, x, layers)
        # base t (0..T-1): step j reads token x[t+1] (j=0) or the target's greedy token at t+j,
        # and is trained toward the target's greedy token after position t+1+j.
        tokens = [x[:, 1 : T + 1]] + [greedy[:, j : T + j] for j in range(1, ttt)]
        labels = [greedy[:, 1 + j : T + 1 + j] for j in range(ttt)]
        logits = draft(aux[:, :T], tokens, ttt)
        losses = [F.cross_entropy(lg.float().reshape(-1, VOCAB), lb.reshape(-1)) for lg, lb in zip(logits, labels)]
        loss = sum(w * step_loss for w, step_loss in zip([0.8 ** j for j in range(ttt)], losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            acc = [float((lg.argmax(-1) == lb).float().mean()) for lg, lb in zip(logits, labels)]
            print(f"draft step {step} loss {loss.item():.3f} acc/step {[round(a, 3) for a in acc]} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    log["draft_final_train_top1_per_step"] = [round(a, 4) for a in acc]
    out.mkdir(parents=True, exist_ok=True)
    save_file(draft.state_dict_hf(), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB, "hidden_size": DRAFT["hidden_size"], "intermediate_size": DRAFT["intermediate_size"],
        "num_hidden_layers": 1, "num_attention_heads": DRAFT["num_attention_heads"],
        "num_key_value_heads": DRAFT["num_key_value_heads"], "rms_norm_eps": DRAFT["rms_norm_eps"],
        "max_position_embeddings": TARGET["max_position_embeddings"], "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "target_hidden_size": TARGET["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="examples/checkpoints")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=3000)
    ap.add_argument("--draft-steps", type=int, default=2000)
    ap.add_argument("--ttt-steps", type=int, default=4)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = Path(args.out)
    target_dir, draft_dir = out / "tiny-code", out / "tiny-code-eagle3"
    train, held = stdlib_files()
    texts = read(train)
    log: dict = {"stdlib_train_files": len(train), "stdlib_heldout_files": len(held), "device": args.device,
                 "seed": args.seed, "target_steps": args.target_steps, "draft_steps": args.draft_steps,
                 "ttt_steps": args.ttt_steps}
    t0 = time.time()
    tok = train_tokenizer(texts, target_dir)
    stream = token_stream(tok, texts)
    log["train_tokens"] = int(stream.numel())
    target = train_target(stream, target_dir, args.target_steps, args.device, args.seed, log)
    held_stream = token_stream(tok, read(held))
    with torch.no_grad():
        g = torch.Generator().manual_seed(99)
        x = windows(held_stream, 64, 257, g).to(args.device)
        logits = target(x[:, :-1]).logits.float()
        log["target_heldout_loss"] = round(F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)).item(), 4)
    train_draft(target, stream, draft_dir, args.draft_steps, args.ttt_steps, args.device, args.seed, log)
    log["seconds"] = round(time.time() - t0, 1)
    (out / "tiny-code-training.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log, indent=2))


if __name__ == "__main__":
    main()
