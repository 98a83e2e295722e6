"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464) and its short causal conv, in torch: the reference
every faster path is compared with, and the CPU path.

Per value head the state S is a [Dk, Dv] matrix. For each token t (q, k l2-normalised, q scaled by Dk^-0.5):

    S = exp(g_t) * S                      decay (g_t <= 0)
    S = S + k_t (beta_t (v_t - S^T k_t))^T  the delta rule: write only what S does not already predict
    o_t = S^T q_t

`recurrent` runs that loop (decode: one token per sequence, a batch of sequences at once). `chunked` computes
the same thing a chunk of C tokens at a time (prefill): inside a chunk the rank-one updates compound into one
lower-triangular system (the UT transform) solved once, so the work is matmuls, and only the chunk boundaries
are sequential. Both start from a given state and return the final one, so a prompt can be split into any
chunks and then decoded token by token with the same result (the engine relies on that).

Layout: heads first, one sequence: q, k [H, L, Dk]; v [H, L, Dv]; g, beta [H, L]; state [H, Dk, Dv]; all fp32
(the state accumulates over the whole context, so it is kept and computed in fp32 whatever the model dtype).

Kimi Delta Attention (KDA: Kimi Linear, GLM-5.3-Flash) is the same rule with a decay per key channel: g is
[H, L, Dk] and S = diag(exp(g_t)) S. `recurrent` takes either shape of g; `chunked_per_channel` is the chunked
form for it (the decay between two tokens of a chunk is then a vector, so the chunk's score and write matrices
sum over the key channels instead of scaling one dot product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (the size transformers and flash-linear-attention use)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # rsqrt(sum + eps), not F.normalize's max(norm, eps): the form the checkpoints were trained with.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """l2-normalised q (scaled by Dk^-0.5) and k, in fp32."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over a batch: q, k [B, H, L, Dk] (prepared), v [B, H, L, Dv], g [B, H, L] (or
    [B, H, L, Dk] per key channel), beta [B, H, L], state [B, H, Dk, Dv]. Returns (out [B, H, L, Dv], final state); `state` is not modified."""
    s = state.float()
    outs = []
    per_channel = g.dim() == 4  # KDA: g [B, H, L, Dk] decays each key channel (row of S) on its own
    for t in range(q.shape[2]):
        decay = g[:, :, t].exp()
        s = s * (decay[..., None] if per_channel else decay[..., None, None])
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, :, t])
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(outs, dim=2), s


def chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk by chunk: q, k [H, L, Dk] (prepared), v [H, L, Dv], g, beta [H, L], state
    [H, Dk, Dv]. Returns (out [H, L, Dv], final state)."""
    h, length, dk = k.shape
    pad = -length % chunk
    if pad:  # padded tokens have k = v = 0 and g = 0: they change neither the outputs nor the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (length + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    cum = g.cumsum(-1)  # log of the decay from the chunk's start through each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j): what token j's write has decayed by when token i reads (j <= i)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # Within a chunk each write sees the earlier writes of the same chunk: (I + A) u = beta v with A strictly
    # lower triangular; solving once turns the chunk's updates into matmuls.
    a = (kb @ k.transpose(-1, -2)) * decay
    eye = torch.eye(chunk, dtype=a.dtype, device=a.device)
    system = a.masked_fill(~causal, 0.0).tril(-1) + eye
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1:]  # [h, n, 1]
    k_to_end = k * (last - cum).exp()[..., None]
    s = state.float()
    out = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ s  # what the chunk writes, less what the incoming state predicts
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ v_new
        s = s * last[:, c].exp()[..., None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    return out.reshape(h, n * chunk, -1)[:, :length], s


def chunked_per_channel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` with a decay per key channel (KDA): q, k [H, L, Dk] (prepared), v [H, L, Dv], g [H, L, Dk],
    beta [H, L], state [H, Dk, Dv]. Returns (out [H, L, Dv], final state). One chunk at a time, so the
    [H, C, C, Dk] pairwise decays of only one chunk are ever held."""
    h, length, dk = k.shape
    pad = -length % chunk
    if pad:  # padded tokens have k = v = 0 and g = 0: they change neither the outputs nor the state
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, dtype=torch.float32, device=q.device)
    s = state.float()
    out = torch.empty_like(v)
    for lo in range(0, length + pad, chunk):
        sl = slice(lo, lo + chunk)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        cum = g[:, sl].cumsum(1)  # [h, C, Dk]: log decay of each channel from the chunk's start
        # decay[i, j, d] = exp(cum_i,d - cum_j,d) for j <= i (0 above the diagonal, never overflowing)
        diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        decay = diff.exp()
        kb = kc * bc[..., None]
        a = torch.einsum("hid,hjd,hijd->hij", kb, kc, decay)
        system = a.tril(-1) + eye
        u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * cum.exp(), upper=False, unitriangular=True)
        scores = torch.einsum("hid,hjd,hijd->hij", qc, kc, decay)
        v_new = u - w @ s  # what the chunk writes, less what the incoming state predicts
        out[:, sl] = (qc * cum.exp()) @ s + scores @ v_new
        last = cum[:, -1:]  # [h, 1, Dk]
        s = s * last.transpose(1, 2).exp() + (kc * (last - cum).exp()).transpose(1, 2) @ v_new
    return out[:, :length], s


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d then SiLU over one sequence. x [C, L]; weight [C, K]; state [C, K-1] (the
    previous K-1 inputs, zeros at the start). Returns (out [C, L], the new state: the last K-1 inputs)."""
    full = torch.cat([state.to(x.dtype), x], dim=-1)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=x.shape[0]).squeeze(0)
    return F.silu(out), full[:, -state.shape[-1] :]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of sequences: x [B, C]; state [B, C, K-1]. Returns (out [B, C], new state)."""
    full = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    return F.silu((full * weight).sum(-1)), full[:, :, 1:]
