"""The multi-token-prediction head of the hybrid Qwen family as plain torch: its weights in the released layout
(`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`), its twin (the
reference for models/mtp.py and what training differentiates), and training of a head on a model's own greedy
outputs — so a random model's head drafts something its model keeps (tests/mtp_models.py on the CPU, the GPU
check's MTP block, agentbox/bench/gpu_mtp.py, at Qwen3.8-27B's shape).

transformers' Qwen3.5 has no MTP module (it drops `mtp.*` at load), so the twin is written from the published
architecture: x = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)]); one gated full-attention decoder layer (q_proj
yields a query and a gate per head, zero-centred q/k norms, partial neox rope, GQA); a final norm; the model's LM
head. Every norm is zero-centred (x * (1 + w))."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


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


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), w.shape, 1.0 + w.float(), eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary: int, theta: float) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, rotary, 2, device=positions.device).float() / rotary))
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


def train_head(text: Any, embed: torch.Tensor, head: torch.Tensor, data: list[tuple[torch.Tensor, torch.Tensor]],
               steps: int = 300, seed: int = 0, lr: float = 3e-3) -> tuple[dict[str, torch.Tensor], list[float]]:
    """A head trained on greedy sequences: data holds (tokens [T], the model's final hidden states [T, H]) per
    sequence; at each position p the head reads the hidden state at p and the token at p + 1 and learns the token
    at p + 2. Weights in fp32 on embed's device. Returns them and the loss at the first and the last step."""
    device = embed.device
    w = {k: v.to(device).requires_grad_(True) for k, v in random_mtp(text, seed + 1).items()}
    opt = torch.optim.Adam(w.values(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(F.cross_entropy(mtp_twin(w, text, embed, h[: len(t) - 2], t[1:-1],
                                            torch.arange(len(t) - 2, device=device)) @ head.T, t[2:])
                   for t, h in data) / len(data)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach() for k, v in w.items()}, [losses[0], losses[-1]]
