"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4; GLM-5's next models use the same): the residual
stream is `n` parallel streams [T, n, D]. Before each block a small projection of all streams gives three sets
of weights: `pre` collapses the streams into the block's input, `post` spreads the block's output over them,
and `comb` (n x n, made doubly stochastic by Sinkhorn-Knopp so the mix never grows the norm) mixes the old
streams into the new ones. The weights and their arithmetic are fp32 whatever the model's dtype, as the
reference keeps them (`_keep_in_fp32_modules_strict`). Replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, the rms taken in fp32 and cast to x's dtype before the product."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _fp32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, n: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        self.fn = _fp32((2 + n) * n, n * hidden_size)
        self.base = _fp32((2 + n) * n)
        self.scale = _fp32(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (post [T, n], comb [T, n, n] fp32, the block's input [T, D] in the streams' dtype)."""
        n = self.n
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams: the block's output spread by `post`, plus the old streams mixed by comb (transposed:
        new stream k takes sum_j comb[j, k] * old stream j)."""
        dtype = streams.dtype
        return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state (sigmoid weights, no mixing)."""

    def __init__(self, hidden_size: int, n: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = _fp32(n, n * hidden_size)
        self.base = _fp32(n)
        self.scale = _fp32(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
