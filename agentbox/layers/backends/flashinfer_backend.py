"""The flashinfer backend: flashinfer's paged prefill and decode wrappers over our page tables.

UNVERIFIED: flashinfer is not installed on any machine this was written on; it follows flashinfer's documented
wrapper API (BatchPrefillWithPagedKVCacheWrapper / BatchDecodeWithPagedKVCacheWrapper: `plan` once per step
on the host, `run` per layer) and is registered only where the package imports.

Our cache [num_slots, Hkv, D] with slot = page * page_size + offset is flashinfer's NHD layout viewed as
[num_pages, page_size, Hkv, D]; a sequence's pages become the CSR triple (indptr, indices, last_page_len).
flashinfer's causal mask for appended tokens is bottom-right aligned, as ours. Sliding window W is its
window_left = W - 1 (it counts the keys left of the query). One plan per distinct window in the model, made on
first use in a step. Sinks are not supported here (refused, not approximated); decode runs eagerly (no
CUDA-graph hooks: flashinfer's graph wrappers need buffers this unverified backend does not wire up).
"""

from __future__ import annotations

from typing import Any

import torch

from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata, KVCache, register_backend

WORKSPACE_BYTES = 128 << 20  # flashinfer's own examples use 128 MiB


@register_backend
class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        import flashinfer

        self._fi = flashinfer
        self._device = kv_cache.k[0].device
        # (decode?, window_left) -> wrapper, made once (each holds pinned host buffers); planned once per step.
        self._wrappers: dict[tuple[bool, int], Any] = {}
        self._planned: set[tuple[bool, int]] = set()
        self._csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def unavailable_reason(cls, device: str, auto: bool = False) -> str | None:
        if device != "cuda":
            return "flashinfer runs on CUDA only"
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # a broken install (missing CUDA toolkit for its JIT) is not fatal: fall back
            return f"flashinfer does not import: {e}"
        return None

    def begin(self, meta: AttentionMetadata) -> None:
        super().begin(meta)
        ps = meta.page_size
        pages_per_seq = [-(-kv // ps) for kv in meta.kv_lens]
        table = meta.page_table.cpu()
        indices = torch.cat([table[i, :n] for i, n in enumerate(pages_per_seq)]).to(torch.int32)
        indptr = torch.tensor([0, *torch.tensor(pages_per_seq).cumsum(0).tolist()], dtype=torch.int32)
        last = torch.tensor([kv - (n - 1) * ps for kv, n in zip(meta.kv_lens, pages_per_seq, strict=True)],
                            dtype=torch.int32)
        qo = torch.tensor([0, *torch.tensor(meta.query_lens).cumsum(0).tolist()], dtype=torch.int32)
        # As vLLM hands them over: offsets and last-page lengths on the host (plan reads them there, no sync),
        # the page ids on the device (the kernels read them).
        self._csr = (qo, indptr, indices.to(self._device), last)
        self._planned = set()  # re-planned lazily for this step's layout

    def _wrapper(self, window_left: int, dtype: torch.dtype) -> Any:
        meta, csr = self.meta, self._csr
        assert meta is not None and csr is not None
        decode = meta.is_decode_only
        key = (decode, window_left)
        wrapper = self._wrappers.get(key)
        if wrapper is not None and key in self._planned:
            return wrapper
        if wrapper is None:
            # Its own workspace: a plan lives in it, and two windows (gpt-oss) are planned in one step.
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
            if decode:
                # Tensor cores: flashinfer's decode kernels without them take only some GQA group sizes.
                wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            else:
                wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._wrappers[key] = wrapper
        qo, indptr, indices, last = csr
        kv_dtype = self.kv_cache.k[0].dtype
        if decode:
            wrapper.plan(
                indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, meta.page_size,
                window_left=window_left, q_data_type=dtype, kv_data_type=kv_dtype, sm_scale=self.scale,
            )
        else:
            wrapper.plan(
                qo, indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, meta.page_size,
                causal=True, window_left=window_left, q_data_type=dtype, kv_data_type=kv_dtype,
                sm_scale=self.scale,
            )
        self._planned.add(key)
        return wrapper

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        meta = self.meta
        if meta is None:
            raise RuntimeError("FlashInferAttention.forward before begin(meta)")
        if sinks is not None:
            raise ValueError("the flashinfer backend does not support attention sinks; use --attention triton")
        if q.shape[-1] != self.head_dim or (scale is not None and scale != self.scale):
            # its wrappers are planned once per step for one head size and scale
            raise ValueError("the flashinfer backend needs one head size and scale for every layer (this model "
                             "varies them per layer); use --attention triton")
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        slots = meta.slot_mapping.to(torch.int64)
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        ps, hkv, d = meta.page_size, self.num_kv_heads, self.head_dim
        paged = (k_cache.view(-1, ps, hkv, d), v_cache.view(-1, ps, hkv, d))
        window_left = -1 if sliding_window is None else sliding_window - 1
        return self._wrapper(window_left, q.dtype).run(q.contiguous(), paged)
