"""A tiny Qwen3.5 checkpoint with a multi-token-prediction head in the released layout (`mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`; config
`text_config.mtp_num_hidden_layers: 1`), the head's plain-torch twin (the reference for models/mtp.py and what
training differentiates), and training of the head on the tiny model's own greedy outputs.

transformers' Qwen3.5 has no MTP module (it drops `mtp.*` at load), so the twin is written here from the
published architecture: x = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)]); one gated full-attention decoder layer
(q_proj yields a query and a gate per head, zero-centred q/k norms, partial neox rope, GQA); a final norm; the
model's LM head. Every norm is zero-centred (x * (1 + w))."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hybrid_models import configs, save_hybrid
from safetensors.torch import save_file


def text_config() -> Any:
    return configs()["qwen3_5"].get_text_config()


def mtp_shapes(text: Any) -> dict[str, tuple[int, ...]]:
    h, hd, inter = text.hidden_size, text.head_dim, text.intermediate_size
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (2 * heads * hd, h),
        p + "self_attn.k_proj.weight": (kv * hd, h),
        p + "self_attn.v_proj.weight": (kv * hd, h),
        p + "self_attn.o_proj.weight": (h, heads * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }


def random_mtp(text: Any, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in mtp_shapes(text).items():
        scale = 0.1 if "norm" in name else 0.08  # zero-centred norms store w - 1: small values
        out[name] = scale * torch.randn(shape, generator=g)
    return out


def save_with_mtp(path: Path, mtp: dict[str, torch.Tensor] | None = None, seed: int = 0,
                  family: str = "qwen3_5") -> torch.nn.Module:
    """The tiny Qwen3.5 (or Qwen3.5-MoE) of hybrid_models.py plus an MTP head: `mtp.safetensors` beside the
    model's file, and `mtp_num_hidden_layers` in its text config, as the released checkpoints have them. The MoE
    head's layer is the model's attention layer's tensors under `mtp.layers.0.` (its experts, router and shared
    expert named as transformers saves the model's own), with random fc and norms."""
    hf = save_hybrid(configs()[family], path, seed)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = mtp if mtp is not None else random_mtp(hf.config.get_text_config())
    if family != "qwen3_5" and mtp is None:
        from safetensors.torch import load_file

        layer = "model.language_model.layers.3."
        trunk_tensors = load_file(str(path / "model.safetensors"))
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.layers.0.")}
        tensors |= {"mtp.layers.0." + k[len(layer):]: v for k, v in trunk_tensors.items() if k.startswith(layer)}
    save_file({k: v.detach().contiguous().float() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return hf


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), w.shape, 1.0 + w.float(), eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary: int, theta: float) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, rotary, 2).float() / rotary))
    ang = positions.float()[:, None] * inv[None]  # [T, rotary / 2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    r, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
    return torch.cat([r * cos + rotated * sin, rest], -1)


def mtp_twin(w: dict[str, torch.Tensor], text: Any, embed: torch.Tensor, hidden: torch.Tensor,
             next_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The head over one sequence's rows (causal among them): [T, H] hidden states after `mtp.norm`."""
    eps, hd = text.rms_norm_eps, text.head_dim
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    rotary = int(hd * text.rope_parameters["partial_rotary_factor"])
    theta = text.rope_parameters["rope_theta"]
    p = "mtp.layers.0."
    x = torch.cat([_norm(embed[next_ids], w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].T
    t = x.shape[0]
    a = _norm(x, w[p + "input_layernorm.weight"], eps)
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, hd)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, hd)
    q = _rope(_norm(q, w[p + "self_attn.q_norm.weight"], eps), positions, rotary, theta)
    k = _rope(_norm(k, w[p + "self_attn.k_norm.weight"], eps), positions, rotary, theta)
    rep = heads // kv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1)
    o = (attn * torch.sigmoid(gate)).reshape(t, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
    x = x + o
    m = _norm(x, w[p + "post_attention_layernorm.weight"], eps)
    x = x + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
        @ w[p + "mlp.down_proj.weight"].T
    return _norm(x, w["mtp.norm.weight"], eps)


def trunk(hf: torch.nn.Module, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states after the model's norm [B, T, H], the LM head's weight) of the transformers model, for
    sequences of one length (one batched forward: its delta-rule fallback costs seconds a call on a CPU)."""
    with torch.no_grad():
        out = hf.model.language_model(input_ids=torch.tensor(seqs))
    return out.last_hidden_state.float(), hf.lm_head.weight.float()


def engine_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Prompt + n greedy tokens each, decoded by our engine (exact against transformers on this model, and
    seconds faster than its generate on a CPU)."""
    from agentbox.config import EngineConfig, Speculative
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    config = EngineConfig(model=str(path), attention="torch", speculative=Speculative.OFF, host_cache_gb=0.0,
                          num_pages=256)
    with LLM(config) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


def train_mtp(hf: torch.nn.Module, path: Path, prompts: list[list[int]], steps: int = 300, new_tokens: int = 40,
              seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The head trained on the model's own greedy outputs: at each position p of a greedy sequence it reads the
    model's hidden state at p and the token at p + 1 and learns the token at p + 2. Returns its weights and the
    loss at the first and the last step."""
    text = hf.config.get_text_config()
    embed = hf.model.language_model.embed_tokens.weight.detach().float()
    data = []  # (tokens, hidden) per sequence; one trunk forward per length
    by_length: dict[int, list[list[int]]] = {}
    for seq in engine_greedy(path, prompts, new_tokens):
        by_length.setdefault(len(seq), []).append(seq)
    for group in by_length.values():
        hidden, head = trunk(hf, group)
        data += [(torch.tensor(seq), hidden[b]) for b, seq in enumerate(group)]
    w = {k: v.clone().requires_grad_(True) for k, v in random_mtp(text, seed + 1).items()}
    opt = torch.optim.Adam(w.values(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(F.cross_entropy(mtp_twin(w, text, embed, h[: len(t) - 2], t[1:-1], torch.arange(len(t) - 2))
                                   @ head.T, t[2:]) for t, h in data) / len(data)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach() for k, v in w.items()}, [losses[0], losses[-1]]


# Prompts the tests decode; the head is trained on the model's greedy continuations of all of them (a tiny random
# model's next tokens follow no pattern a head could generalise from 300 steps: on prompts it never saw it drafts
# nothing the model keeps).
BASE = [(7 * i + 3) % 250 + 1 for i in range(12)]
PROMPTS = [BASE * 3, BASE[:5] * 4 + [9, 8, 7]]
TRAIN = [[(7 * i + 11 * j) % 250 + 1 for i in range(10)] for j in range(6)] + PROMPTS
PROSE = [(13 * i + 5) % 250 + 1 for i in range(16)]  # repeats nothing: a text match finds no draft


def bench_workloads(path: Path, new_tokens: int = 40) -> dict[str, list[int]]:
    """`agentbox bench spec --workloads`: prose, and an edit-shaped prompt that re-sends the model's earlier
    answer (the prompt, the answer, the prompt again), as an agent re-sends a file."""
    answer = engine_greedy(path, [PROSE[:10]], new_tokens)[0]
    return {"prose": PROSE, "edit": answer + PROSE[:10]}


def trained_checkpoint(path: Path, steps: int = 300) -> tuple[torch.nn.Module, dict[str, list[int]], list[float], float]:
    """The tiny Qwen3.5 with its head trained on its own greedy continuations of TRAIN and the bench workloads:
    (the transformers model, the workloads, the first and last loss, the seconds training took)."""
    import time

    hf = save_with_mtp(path)
    workloads = bench_workloads(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 64-wide matrices: threads cost more than they give on a shared CPU
    t0 = time.monotonic()
    try:
        weights, losses = train_mtp(hf, path, TRAIN + list(workloads.values()), steps=steps)
    finally:
        torch.set_num_threads(threads)
    seconds = time.monotonic() - t0
    save_with_mtp(path, weights)
    return hf, workloads, losses, seconds
