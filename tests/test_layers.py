"""Layer tests: the torch attention backend against naive per-sequence attention, TP weight loaders by
reassembling shards, rotary against transformers, RMSNorm's fused residual."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from agentbox.layers.attention import Attention
from agentbox.layers.backends import ATTENTION_BACKENDS
from agentbox.layers.backends.base import AttentionMetadata, KVCache
from agentbox.layers.backends.torch_backend import TorchAttention, build_layout
from agentbox.layers.context import forward_context
from agentbox.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agentbox.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from agentbox.layers.norm import RMSNorm
from agentbox.layers.rotary import RotaryEmbedding, rope_parameters
from agentbox.layers.weight_loading import load_weight
from agentbox.parallel.state import set_tp_state

# --- attention backend ---------------------------------------------------------------------------


def make_step(
    query_lens: list[int], kv_lens: list[int], page_size: int, num_pages: int, seed: int = 0
) -> tuple[AttentionMetadata, list[list[int]]]:
    """A layout where sequence i owns randomly chosen pages; returns the metadata and each sequence's slots."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_pages, generator=g).tolist()
    pages = [[free.pop() for _ in range(math.ceil(kv / page_size))] for kv in kv_lens]
    slots = [
        [p[j // page_size] * page_size + j % page_size for j in range(kv)]
        for p, kv in zip(pages, kv_lens, strict=True)
    ]
    new_slots = [s for seq, q, kv in zip(slots, query_lens, kv_lens, strict=True) for s in seq[kv - q :]]
    width = max(len(p) for p in pages)
    meta = AttentionMetadata(
        query_lens=query_lens,
        kv_lens=kv_lens,
        page_table=torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
        page_size=page_size,
    )
    return meta, slots


def naive_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    slots,
    scale: float,
) -> torch.Tensor:
    """One sequence at a time, explicit softmax in float64, GQA by head index."""
    out, start = [], 0
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for seq, (q_len, kv_len) in enumerate(zip(meta.query_lens, meta.kv_lens, strict=True)):
        qs = q[start : start + q_len].double()  # [q, H, D]
        ks = k_cache[slots[seq]].double().repeat_interleave(heads // kv_heads, dim=1)  # [kv, H, D]
        vs = v_cache[slots[seq]].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        qpos = torch.arange(kv_len - q_len, kv_len)[:, None]
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > qpos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += q_len
    return torch.cat(out)


LAYOUTS = {
    "decode-only": ([1, 1, 1], [7, 1, 20]),
    "prefill-only": ([5, 9], [5, 9]),
    "mixed": ([1, 6, 1, 3, 12], [33, 6, 2, 11, 12]),  # decodes, a fresh prefill, chunks after cached prefixes
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_matches_naive(layout: str, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    query_lens, kv_lens = LAYOUTS[layout]
    page_size, num_pages, d = 4, 32, 16
    meta, slots = make_step(query_lens, kv_lens, page_size, num_pages)
    cache = KVCache.uniform(2, num_pages, page_size, kv_heads, d, dtype, "cpu")
    torch.manual_seed(1)
    for layer in range(2):  # the cached prefix: random k/v already in place
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    t = sum(query_lens)
    q = torch.randn(t, heads, d, dtype=dtype)
    k, v = torch.randn(t, kv_heads, d, dtype=dtype), torch.randn(t, kv_heads, d, dtype=dtype)
    backend = TorchAttention(cache, heads, kv_heads, d, d**-0.5)
    backend.begin(meta)
    out = backend.forward(1, q, k, v)
    assert out.shape == (t, heads, d) and out.dtype == dtype
    torch.testing.assert_close(cache.k[1][meta.slot_mapping], k)  # new k/v stored at their slots
    torch.testing.assert_close(cache.v[1][meta.slot_mapping], v)
    expected = naive_attention(q, cache.k[1], cache.v[1], meta, slots, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def consecutive_step(query_lens: list[int], kv_lens: list[int], page_size: int) -> AttentionMetadata:
    """Sequence i owns a run of consecutive pages (as a fresh pool hands them out), runs in reverse order."""
    counts = [math.ceil(kv / page_size) for kv in kv_lens]
    first, pages = 1 + sum(counts), []
    for n in counts:
        first -= n
        pages.append(list(range(first, first + n)))
    slots = [[p[j // page_size] * page_size + j % page_size for j in range(kv)] for p, kv in zip(pages, kv_lens, strict=True)]
    width = max(counts)
    return AttentionMetadata(
        query_lens=query_lens,
        kv_lens=kv_lens,
        page_table=torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32),
        slot_mapping=torch.tensor(
            [s for seq, q, kv in zip(slots, query_lens, kv_lens, strict=True) for s in seq[kv - q :]], dtype=torch.int64
        ),
        page_size=page_size,
    )


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_view_path_equals_gather_path(window: int | None, with_sinks: bool) -> None:
    """Consecutive pages take the view path (no copy of the history); it gives the gather path's outputs on a
    ragged batch of decodes, a fresh prefill and prefill chunks after cached prefixes, with GQA, sinks and a
    window; pages out of order fall back to the gather."""
    query_lens, kv_lens = [1, 6, 1, 3, 12, 5], [33, 6, 2, 11, 12, 40]
    heads, kv_heads, d, page_size = 6, 2, 16, 4
    meta = consecutive_step(query_lens, kv_lens, page_size)
    torch.manual_seed(3)
    cache = KVCache.uniform(1, 40, page_size, kv_heads, d, torch.float32, "cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    t = sum(query_lens)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    sinks = torch.randn(heads) if with_sinks else None
    outs = []
    for use_views in (True, False):
        caches = KVCache.uniform(1, 40, page_size, kv_heads, d, torch.float32, "cpu")
        caches.k[0].copy_(cache.k[0])
        caches.v[0].copy_(cache.v[0])
        backend = TorchAttention(caches, heads, kv_heads, d, d**-0.5)
        backend.use_views, backend.view_min_mean_kv = use_views, 0  # short sequences, views all the same
        backend.use_cpu_kernel = False  # the paths under test, not cpu_attention.c
        backend.begin(meta)
        assert (backend.bases is not None) == use_views
        outs.append(backend.forward(0, q, k, v, sliding_window=window, sinks=sinks))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    shuffled, _ = make_step(query_lens, kv_lens, page_size, num_pages=40, seed=5)
    backend.use_views = True
    backend.begin(shuffled)
    assert backend.bases is None and backend.layout is not None
    backend.view_min_mean_kv = 128  # the default: these sequences are too short to gain from views
    backend.begin(meta)
    assert backend.bases is None


def test_layout_mask_and_indices() -> None:
    meta, _ = make_step([1, 3], [4, 5], page_size=2, num_pages=8)
    lay = build_layout(meta, torch.device("cpu"))
    assert (lay.num_seqs, lay.max_q, lay.max_kv) == (2, 3, 5)
    assert lay.q_index.tolist() == [0, 3, 4, 5]  # seq 0 row 0, seq 1 rows 0..2 of the padded [2 * 3]
    # seq 0 (decode at position 3) sees keys 0..3; seq 1 (3 new after 2 cached) sees 0..2, 0..3, 0..4.
    assert lay.mask[0, 0, 0].tolist() == [True, True, True, True, False]
    assert lay.mask[1, 0].tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    pages = meta.page_table.long()
    assert lay.kv_slots[1].tolist() == [int(pages[1, j // 2]) * 2 + j % 2 for j in range(5)]


def test_bad_layout_and_missing_begin_are_refused() -> None:
    cache = KVCache.uniform(1, 4, 4, 1, 8, torch.float32, "cpu")
    backend = TorchAttention(cache, 1, 1, 8, 1.0)
    x = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="before begin"):
        backend.forward(0, x, x, x)
    meta, _ = make_step([3], [2], page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="bad step layout"):
        backend.begin(meta)


def test_attention_layer_runs_the_context_backend() -> None:
    assert ATTENTION_BACKENDS["torch"] is TorchAttention
    meta, slots = make_step([2, 1], [2, 3], page_size=4, num_pages=8)
    cache = KVCache.uniform(3, 8, 4, 2, 8, torch.float32, "cpu")
    cache.k[2].normal_()
    cache.v[2].normal_()
    backend = TorchAttention(cache, 4, 2, 8, 0.3)
    layer = Attention(4, 2, 8, 0.3, layer_id=2)
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    with forward_context(backend, meta):
        out = layer(q, k, v)
        with pytest.raises(RuntimeError, match="do not nest"), forward_context(backend, meta):
            pass
    assert out.shape == (3, 32)
    expected = naive_attention(q.view(3, 4, 8), cache.k[2], cache.v[2], meta, slots, 0.3)
    torch.testing.assert_close(out.double(), expected.reshape(3, 32), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside a forward context"):
        layer(q, k, v)


@pytest.mark.gpu
def test_torch_backend_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    query_lens, kv_lens = LAYOUTS["mixed"]
    meta, slots = make_step(query_lens, kv_lens, 4, 32)
    cache = KVCache.uniform(1, 32, 4, 2, 64, torch.bfloat16, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    t = sum(query_lens)
    q = torch.randn(t, 8, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(t, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(t, 2, 64, dtype=torch.bfloat16, device="cuda")
    backend = TorchAttention(cache, 8, 2, 64, 0.125)
    meta.page_table, meta.slot_mapping = meta.page_table.cuda(), meta.slot_mapping.cuda()
    backend.begin(meta)
    out = backend.forward(0, q, k, v)
    meta.page_table, meta.slot_mapping = meta.page_table.cpu(), meta.slot_mapping.cpu()
    expected = naive_attention(q.cpu(), cache.k[0].cpu(), cache.v[0].cpu(), meta, slots, 0.125)
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-2, rtol=3e-2)


# --- tensor-parallel weight loaders ----------------------------------------------------------------


@pytest.fixture
def restore_tp() -> Iterator[None]:
    yield
    set_tp_state(0, 1)


def per_rank(build, tp: int = 2) -> list:
    """Build one module per simulated rank (layers read rank/size at construction), then run at tp=1 so
    collectives are no-ops and each module returns its own partial result."""
    mods = []
    for rank in range(tp):
        set_tp_state(rank, tp)
        mods.append(build())
    set_tp_state(0, 1)
    return mods


def test_column_and_row_parallel_reassemble(restore_tp: None) -> None:
    w, b, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    cols = per_rank(lambda: ColumnParallelLinear(6, 8, bias=True))
    for m in cols:
        load_weight(m.weight, w)
        load_weight(m.bias, b)
    torch.testing.assert_close(torch.cat([m(x) for m in cols], -1), F.linear(x, w, b))

    w2, b2, x2 = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    rows = per_rank(lambda: RowParallelLinear(8, 5, bias=True))
    for m in rows:
        load_weight(m.weight, w2)
        load_weight(m.bias, b2)
    parts = [m(x2[:, r * 4 : (r + 1) * 4]) for r, m in enumerate(rows)]  # bias added by rank 0 only
    torch.testing.assert_close(sum(parts), F.linear(x2, w2, b2))


def test_qkv_and_merged_loaders_place_shards(restore_tp: None) -> None:
    d, heads, kv_heads, hidden = 4, 4, 2, 8
    wq, wk, wv = (
        torch.randn(heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
    )
    x = torch.randn(2, hidden)
    for rank, m in enumerate(per_rank(lambda: QKVParallelLinear(hidden, d, heads, kv_heads, bias=False))):
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            load_weight(m.weight, w, shard)
        q, k, v = m(x).split([8, 4, 4], -1)  # this rank: 2 q heads, 1 kv head
        torch.testing.assert_close(q, F.linear(x, wq[rank * 8 : (rank + 1) * 8]))
        torch.testing.assert_close(k, F.linear(x, wk[rank * 4 : (rank + 1) * 4]))
        torch.testing.assert_close(v, F.linear(x, wv[rank * 4 : (rank + 1) * 4]))
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        load_weight(m.weight, wq, "x")

    gate, up = torch.randn(6, hidden), torch.randn(6, hidden)
    for rank, m in enumerate(per_rank(lambda: MergedColumnParallelLinear(hidden, [6, 6]))):
        load_weight(m.weight, gate, 0)
        load_weight(m.weight, up, 1)
        g, u = m(x).chunk(2, -1)
        torch.testing.assert_close(g, F.linear(x, gate[rank * 3 : (rank + 1) * 3]))
        torch.testing.assert_close(u, F.linear(x, up[rank * 3 : (rank + 1) * 3]))
    # One KV head over two ranks is replicated; each rank keeps half the query heads.
    assert [(m.num_heads, m.shard.kv_start, m.num_kv_heads) for m in per_rank(
        lambda: QKVParallelLinear(hidden, d, heads, 1))] == [(2, 0, 1), (2, 0, 1)]
    with pytest.raises(ValueError, match="cannot be split"):
        per_rank(lambda: QKVParallelLinear(hidden, d, 3, 1))


def test_head_shard_uneven_kv_groups() -> None:
    from agentbox.parallel.state import HeadShard, head_shard

    # SmolLM2-135M: 9 query heads in 3 KV groups over 2 ranks -> groups 0-1 and group 2.
    assert [head_shard(9, 3, 2, r) for r in range(2)] == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    assert [head_shard(8, 2, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]  # replicated KV heads


def test_vocab_parallel_embedding_and_tied_head(restore_tp: None) -> None:
    vocab, hidden = 11, 4  # does not divide by 2: the last rank's range is padded
    table, ids, h = torch.randn(vocab, hidden), torch.tensor([0, 5, 6, 10, 3]), torch.randn(2, hidden)
    embeds = per_rank(lambda: VocabParallelEmbedding(vocab, hidden))
    heads = per_rank(lambda: ParallelLMHead(vocab, hidden))
    for e, head in zip(embeds, heads, strict=True):
        load_weight(e.weight, table)
        head.tie_to(e)
        assert head.weight is e.weight
    torch.testing.assert_close(sum(e(ids) for e in embeds), F.embedding(ids, table))
    logits = torch.cat([head(h) for head in heads], -1)[:, :vocab]
    torch.testing.assert_close(logits, h @ table.T)


# --- norm and rotary --------------------------------------------------------------------------------


def test_rmsnorm_fused_residual_equals_unfused() -> None:
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data = torch.randn(16)
    x, res = torch.randn(3, 16), torch.randn(3, 16)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm(x + res))


ROPE = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
}


@pytest.mark.parametrize("kind", list(ROPE))
def test_rotary_matches_transformers_at_any_positions(kind: str) -> None:
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096, **ROPE[kind])
    theta, scaling = rope_parameters(config)
    ours = RotaryEmbedding(64, 4096, theta, scaling)
    positions = torch.tensor([0, 1, 2, 700, 701, 4095, 33])  # arbitrary order and gaps, like a mixed batch
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    eq, ek = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    gq, gk = ours(positions, q, k)
    torch.testing.assert_close(gq, eq[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gk, ek[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_unsupported_rope_scaling_is_refused() -> None:
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        RotaryEmbedding(64, 128, 10000.0, {"rope_type": "longrope", "factor": 4.0})
