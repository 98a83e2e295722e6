"""The MLA kernels (kernels/mla_attention.py) against their torch twin on ragged paged batches, and the tiny
GLM-4.7-Flash through the triton backend (absorbed form for prefill chunks and decode) against transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import DEVICE
from glm_models import save_glm, tiny_config
from hybrid_models import hf_logits
from model_harness import PagedRunner

from agentbox.kernels.mla_attention import mla_attention_ref, mla_decode, mla_extend


def _paged(rank: int, rope: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cache = torch.randn(32 * page, 1, rank + rope, device=DEVICE)
    table = torch.tensor([[7, 2, 9, 0], [4, 5, 0, 0], [1, 3, 8, 6]], dtype=torch.int32, device=DEVICE)
    return cache, table


def test_mla_decode_and_extend_match_reference() -> None:
    rank, rope, page, heads = 32, 8, 4, 20  # 20 heads: two head tiles, the second one partly masked
    cache, table = _paged(rank, rope, page)
    kv_lens = torch.tensor([9, 5, 14], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, heads, rank + rope, device=DEVICE)
    starts = torch.arange(4, dtype=torch.int32, device=DEVICE)
    ref = mla_attention_ref(q, cache, table, starts, kv_lens, rank=rank, page_size=page, scale=0.3)
    got = mla_decode(q, cache, table, kv_lens, rank=rank, page_size=page, scale=0.3, block_n=16)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # extend: 1, 5 and 3 new tokens (the second sequence all new, the others over a cached prefix)
    starts = torch.tensor([0, 1, 6, 9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(9, heads, rank + rope, device=DEVICE)
    ref = mla_attention_ref(q, cache, table, starts, kv_lens, rank=rank, page_size=page, scale=0.3)
    got = mla_extend(q, cache, table, starts, kv_lens, rank=rank, page_size=page, scale=0.3, block_n=16)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_glm_through_triton_backend_matches_transformers(tmp_path: Path) -> None:
    from agentbox.layers.backends.triton_backend import TritonAttention
    from agentbox.models.loader import load_model

    hf = save_glm(tiny_config(num_hidden_layers=2), tmp_path)
    ours = load_model(str(tmp_path), torch.float32, DEVICE)
    runner = PagedRunner(ours, page_size=4, backend_cls=TritonAttention, device=DEVICE)
    tokens = [(i * 37 + 11) % 256 for i in range(20)]
    out = [runner.step({0: tokens[:12]})[0], runner.step({0: tokens[12:17]})[0]]
    out += [runner.step({0: [t]})[0] for t in tokens[17:]]
    torch.testing.assert_close(torch.cat(out).cpu(), hf_logits(hf, tokens), atol=2e-4, rtol=2e-4)
