"""Multi-head latent attention (MLA: DeepSeek V2/V3, GLM-4.7-Flash) over the paged KV pool, torch reference.

The pool keeps, per token and layer, one "head" of kv_lora_rank + rope_dim values (512 + 64): the normed
latent c and the rotated shared rope key k_pe (`KVLayerSpec(1, 576, 512, tied=True)`: V is the latent's first
kv_lora_rank values, stored once). Every tensor-parallel rank keeps the whole latent (it is shared by all
heads); the ranks split the heads of the up-projections W_UK, W_UV (kv_b_proj) instead.

Two ways to attend, the same numbers:
- expanded (prefill): each visible key's latent goes through kv_b_proj into per-head k_nope [192] and v [256];
  the query [q_nope | q_pe] attends over [k_nope | k_pe] as ordinary multi-head attention. Cheap when the
  queries are many: the up-projection is paid once per key, not once per query head and key.
- absorbed (decode): W_UK folds into the query (q_lat = q_nope W_UK, [H, 512]), so the query [q_lat | q_pe]
  attends straight over the cached 576 values as one-kv-head attention, the output latent is mapped by W_UV.
  No key is ever expanded: what vLLM, SGLang and FlashMLA do for decode.

The triton backend runs both steps in the absorbed form with kernels/mla_attention.py (decode: one query row
per sequence; prefill chunks: one row per new token over its visible prefix); other backends run the torch
references below (any device): expanded for steps with a long prefill chunk, absorbed for the others
(`takes_absorbed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata
from agentbox.layers.backends.torch_backend import build_layout

if TYPE_CHECKING:  # the torch backend's gather layout, reused as is (its type is only named here)
    from agentbox.layers.backends.torch_backend import _StepLayout


@dataclass(frozen=True)
class MLAWeights:
    """This rank's heads of kv_b_proj as dense matrices for the absorbed form."""

    w_uk: torch.Tensor  # [H, qk_nope_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [H, v_head_dim, kv_lora_rank]


class _LayoutMemo:
    """The gather layout of the step being run, built once for every MLA layer of that step."""

    meta: AttentionMetadata | None = None
    layout: _StepLayout | None = None

    def get(self, meta: AttentionMetadata, device: torch.device) -> _StepLayout:
        if self.meta is not meta or self.layout is None:
            self.meta, self.layout = meta, build_layout(meta, device)
        return self.layout


_memo = _LayoutMemo()


def write_latent(backend: AttentionBackend, layer_id: int, latent_keys: torch.Tensor) -> torch.Tensor:
    """Store the step's [T, 576] latent + rope keys at the metadata's slots; returns the layer's cache
    [num_slots, 1, 576]."""
    meta = backend.meta
    if meta is None:
        raise RuntimeError("MLA attention before the backend's begin(meta)")
    cache = backend.kv_cache.k[layer_id]
    slots = meta.slot_mapping.to(cache.device, torch.int64)
    cache.index_copy_(0, slots, latent_keys.unsqueeze(1).to(cache.dtype))
    return cache


def _padded(q: torch.Tensor, lay: _StepLayout) -> torch.Tensor:
    """[T, H, D] -> [B, H, max_q, D] with zero rows for padding."""
    t, h, d = q.shape
    out = q.new_zeros(lay.num_seqs * lay.max_q, h, d)
    out[lay.q_index] = q
    return out.view(lay.num_seqs, lay.max_q, h, d).transpose(1, 2)


def _unpadded(out: torch.Tensor, lay: _StepLayout) -> torch.Tensor:
    """[B, H, max_q, D] -> [T, H, D]."""
    b, h, q, d = out.shape
    return out.transpose(1, 2).reshape(b * q, h, d)[lay.q_index]


def absorbed_reference(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kv_lora_rank: int, scale: float
) -> torch.Tensor:
    """q: [T, H, kv_lora_rank + rope] (q_nope already through W_UK); cache [slots, 1, kv_lora_rank + rope].
    Returns the attended latent [T, H, kv_lora_rank]."""
    lay = _memo.get(meta, cache.device)
    keys = cache[lay.kv_slots].to(q.dtype).transpose(1, 2)  # [B, 1, max_kv, 576]
    padded = _padded(q, lay)
    b, h, max_q, d = padded.shape
    # One kv head: every head's query rows attend as rows of that one head, the mask repeated per head. SDPA's
    # enable_gqa copies the keys once per query head instead: 145 ms against 2.5 a layer at 1,500 keys and 20
    # heads on one core of an EPYC, the copies growing with the history (505 ms against 9.6 at 6,000).
    out = F.scaled_dot_product_attention(
        padded.reshape(b, 1, h * max_q, d), keys, keys[..., :kv_lora_rank], attn_mask=lay.mask.repeat(1, 1, h, 1),
        scale=scale,
    )
    return _unpadded(out.view(b, h, max_q, kv_lora_rank), lay)


def expanded_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b_proj: torch.nn.Module,
    dims: tuple[int, int, int],
    scale: float,
) -> torch.Tensor:
    """q: [T, H, nope + rope]; dims (kv_lora_rank, qk_nope_dim, v_head_dim). Every visible key's latent is
    expanded by kv_b_proj into this rank's heads. Returns [T, H, v_head_dim]."""
    rank, nope, v_dim = dims
    lay = _memo.get(meta, cache.device)
    latent = cache[lay.kv_slots][:, :, 0].to(q.dtype)  # [B, max_kv, 576]
    b, kv, h = latent.shape[0], latent.shape[1], q.shape[1]
    kv_up = kv_b_proj(latent[..., :rank].reshape(b * kv, rank)).view(b, kv, h, nope + v_dim)
    k_pe = latent[..., rank:].unsqueeze(2).expand(b, kv, h, latent.shape[-1] - rank)
    keys = torch.cat([kv_up[..., :nope], k_pe], dim=-1).transpose(1, 2)  # [B, H, max_kv, nope + rope]
    values = kv_up[..., nope:].transpose(1, 2)
    out = F.scaled_dot_product_attention(_padded(q, lay), keys, values, attn_mask=lay.mask, scale=scale)
    return _unpadded(out, lay)


# Longest new-token run a step may give a sequence for the torch reference to take the absorbed form: expanding
# costs kv_b_proj over every visible key (kv x rank x H x (nope + v)) whatever the new tokens, absorbing costs
# each new token's H rows over every key (x (rank + rope + rank)), so absorbing is cheaper below
# 448 x 512 / 576 ~ 400 new tokens at GLM-4.7-Flash's dims (measured on one EPYC core at 5,000 keys, 20 heads:
# 32 new tokens 120 ms absorbed against 805 expanded; 300 new tokens 1.33 s both ways).
ABSORB_MAX_QUERY = 256


def takes_absorbed(backend: AttentionBackend, meta: AttentionMetadata) -> bool:
    """Whether a step's MLA runs in the absorbed form: with the backend's kernels always, on the references for
    decodes, verifies and short extends (ABSORB_MAX_QUERY)."""
    return has_kernels(backend) or meta.is_decode_only or meta.max_query_len <= ABSORB_MAX_QUERY


def has_kernels(backend: AttentionBackend) -> bool:
    """Whether the backend runs MLA in its own kernels (then every step takes the absorbed form)."""
    return backend.name == "triton"


def absorbed_attention(backend: AttentionBackend, q: torch.Tensor, cache: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """q [T, H, rank + rope] -> the attended latent [T, H, rank], by the backend's kernel or the reference."""
    meta = backend.meta
    assert meta is not None
    if not has_kernels(backend):
        return absorbed_reference(q, cache, meta, rank, scale)
    from agentbox.kernels import mla_attention  # imported on first use: triton reads TRITON_INTERPRET then

    meta.ensure_device_tensors(cache.device)
    assert meta.kv_lens_tensor is not None and meta.query_start_loc is not None
    common = dict(rank=rank, page_size=meta.page_size, scale=scale)
    if meta.is_decode_only:
        return mla_attention.mla_decode(q, cache, meta.page_table, meta.kv_lens_tensor, **common)
    return mla_attention.mla_extend(q, cache, meta.page_table, meta.query_start_loc, meta.kv_lens_tensor, **common)


def mla_absorbed(
    backend: AttentionBackend, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w: MLAWeights,
    scale: float,
) -> torch.Tensor:
    """The absorbed form end to end: W_UK into the query, attention over the latent, W_UV out. [T, H, v_head_dim]."""
    rank = w.w_uk.shape[-1]
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w.w_uk.to(q_nope.dtype))
    out_lat = absorbed_attention(backend, torch.cat([q_lat, q_pe], dim=-1), cache, rank, scale)
    return torch.einsum("thc,hvc->thv", out_lat, w.w_uv.to(out_lat.dtype))
