"""Rotary position embedding, neox style (rotate the two halves), as Hugging Face's Llama applies it.

cos/sin are tabulated once in fp32 for every position up to max_position and indexed by the step's
`positions` tensor, so any positions work (a decode at 5000, a prefix-cached chunk starting at 640) and the
lookup is a plain gather that CUDA graphs can capture. Scaling types: default, linear, llama3, yarn
(gpt-oss) and proportional (Gemma 4's global layers); anything else (dynamic NTK, longrope) is refused rather than silently computed wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers config, old (rope_scaling) or new (rope_parameters)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if rope_type == "default" else scaling)


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: low-frequency dims interpolated by `factor`,
    high-frequency dims kept, a linear ramp between; cos/sin scaled by the attention factor."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all else get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty range
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # Same expression as transformers' default rope init, so fp32 results match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "proportional":
        # Gemma 4: the first partial_rotary_factor of the frequencies (still over head_dim) turn, the rest are
        # zero, so the rotation keeps the head's full width: dims i and i + D/2 pair up for i < the rotated share.
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq = inv_freq / float(scaling.get("factor", 1.0))
        inv_freq[angles:] = 0.0
        return inv_freq
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of `head_dim` rotated channels and the attention factor cos/sin are scaled by."""
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
        return _yarn(head_dim, theta, scaling)
    return _inv_freq(head_dim, theta, scaling), 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float = 10000.0, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq, attention = frequencies(head_dim, theta, scaling)
        inv_freq = inv_freq.to(torch.get_default_device())
        t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cached", emb.cos() * attention, persistent=False)
        self.register_buffer("sin_cached", emb.sin() * attention, persistent=False)
        self._positions: torch.Tensor | None = None  # the forward `begin` prepared cos/sin for
        self._cos = self._sin = torch.empty(0)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H, D]; k: [T, Hkv, D]. Returns the rotated q and k."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] rotated. q and k side by side in one tensor cost one set of ops (decode on CPU
        spends more on op dispatch than on arithmetic)."""
        if positions is self._positions and x.dtype == self._cos.dtype:
            cos, sin = self._cos, self._sin
        else:
            cos, sin = self._gather(positions, x.dtype)
        from agentbox.kernels import cpu_dense

        out = cpu_dense.rope_rows(x, cos, sin)  # fp32 on the CPU: one C pass, torch's bits
        return x * cos + _rotate_half(x) * sin if out is None else out

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.cos_cached[positions].unsqueeze(1).to(dtype),
            self.sin_cached[positions].unsqueeze(1).to(dtype),
        )

    def begin(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """Gather this forward's rows once for every layer (the model calls it at the top of each forward,
        so a positions buffer rewritten in place between forwards is gathered afresh)."""
        self._positions = positions
        self._cos, self._sin = self._gather(positions, dtype)


class InterleavedRope(nn.Module):
    """RoPE on the trailing `rope_dim` channels of a head, turning pairs of adjacent channels (DeepSeek-V4's
    `[nope | rope]` heads). cos/sin are computed per step from the positions, as transformers computes them
    (a table over V4's million positions would cost 256 MiB for 32 angles). The attention scale of YaRN is the
    config's `attention_factor` (V4 sets 1.0)."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        inv_freq, self.attention = frequencies(rope_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope_dim / 2] in `dtype` (rounded there first, as the reference hands them over)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.attention).to(dtype), (freqs.sin() * self.attention).to(dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with its last 2 * cos.shape[-1] channels turned in adjacent pairs (cos, sin: [T, R/2];
    -sin turns back). In fp32, cast back to x's dtype."""
    cos = cos.repeat_interleave(2, dim=-1)[:, None]
    sin = sin.repeat_interleave(2, dim=-1)[:, None]
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + turned.float() * sin).to(x.dtype)], dim=-1)
