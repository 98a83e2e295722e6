"""Store the step's new keys and values into the paged cache at their slots (slot = page * page_size + offset).

A negative slot writes nowhere: the CUDA-graph runner pads a decode batch up to a captured size with such rows.
"""

from __future__ import annotations

import torch

from agentbox.kernels._triton import HAS_TRITON, check_runnable, next_pow2, tl, triton

if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kc = k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        vc = v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D] (any row stride, last dim contiguous); caches: [num_slots, Hkv, D]; slot_mapping: [T]."""
    check_runnable(k, k_cache)
    t, num_kv_heads, head_dim = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
    )


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v[keep].to(v_cache.dtype))
