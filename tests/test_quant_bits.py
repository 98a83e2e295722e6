"""The k-bit form (bits 5, 6, 8): GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K as codes + scale (+ offset) exactly
equal to gguf's dequantize, and its packing for the kernels (kernels/dequant.py) lossless."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_quant_gguf import Q4_K_M, quantise, write_quantised

from agentbox.kernels.dequant import dequant_bits, pack_bits, unpack_bits
from agentbox.layers.quant import bits, int4, resident_weight_bytes
from agentbox.layers.quant.gguf import BITS_TYPES, GGUFBlocks, GGUFLinearMethod, bits_groups
from agentbox.layers.quant.quant_rows import PackedRows
from agentbox.layers.weight_loading import load_weight
from agentbox.models.loader import load_model

Q = GGMLQuantizationType
SHAPES = {Q.Q5_0: (5, 32, False), Q.Q5_1: (5, 32, True), Q.Q8_0: (8, 32, False), Q.Q5_K: (5, 32, True), Q.Q6_K: (6, 16, False)}


@pytest.mark.parametrize("qtype", sorted(BITS_TYPES), ids=lambda q: q.name)
def test_bits_groups_are_exactly_gguf_dequantize(qtype: Q) -> None:
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.05, size=(24, 512)).astype(np.float32)
    blocks = GGUFBlocks(qtype, (24, 512), quantise(w, qtype, rng))
    g = bits_groups(blocks)
    bits, group, has_offset = SHAPES[qtype]
    assert (g.bits, g.group, g.offset is not None) == (bits, group, has_offset)
    assert g.codes.dtype == torch.uint8 and g.codes.shape == (24, 512) and int(g.codes.max()) < 2**bits
    assert len(torch.unique(g.codes)) > 2 ** (bits - 1)  # the high bits are really decoded
    assert torch.equal(g.dequantize(), blocks.dequantize())  # bit for bit: the same fp32 products
    # The kernels' layout: K-major, packed; its reference dequantiser gives the same weights.
    qweight, qhigh = pack_bits(g.codes.t().contiguous(), bits)
    assert qweight.shape == (512 // 8, 24) and qhigh.shape == (512 * (bits - 4) // 32, 24)
    offset = None if g.offset is None else g.offset.t().contiguous()
    w_t = dequant_bits(qweight, qhigh, g.scale.t().contiguous(), offset, group, bits)
    assert torch.equal(w_t.t(), blocks.dequantize())


@pytest.mark.parametrize("bits", [5, 6, 8])
def test_pack_bits_round_trips_with_leading_dims(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (3, 64, 7), generator=gen, dtype=torch.uint8)  # [experts, K, N]
    qweight, qhigh = pack_bits(q, bits)
    assert qweight.dtype == qhigh.dtype == torch.int32
    assert qhigh.shape == (3, 64 * (bits - 4) // 32, 7)
    assert torch.equal(unpack_bits(qweight, qhigh, bits), q.to(torch.int32))
    # Row k's high bits sit at bit (bits - 4) * (k % (32 / (bits - 4))) of word k // (32 / (bits - 4)).
    per = 32 // (bits - 4)
    k = per + 3
    assert (int(qhigh[1, k // per, 2]) >> ((bits - 4) * (k % per))) & ((1 << (bits - 4)) - 1) == int(q[1, k, 2]) >> 4


def test_pack_bits_rejects_other_widths() -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_bits(torch.zeros(32, 4, dtype=torch.uint8), 4)


@pytest.mark.parametrize("mix", [*(q.name for q in sorted(BITS_TYPES)), "Q4_K_M"])
def test_the_gpu_form_is_resident_near_the_file(mix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton form (fp16 scales, installed here on CPU tensors) holds every GGUF linear within 10 % of
    the file's bytes for it; Q4_K_M's mixed qkv keeps q/k at 4 bits (not promoted to v's 6)."""
    monkeypatch.setattr(bits, "default_kernel", lambda device: bits.BitsKernel.TRITON)
    monkeypatch.setattr(int4, "default_cpu_kernel", lambda: int4.Int4Kernel.TRITON)
    path = tmp_path / "tiny.gguf"
    write_quantised(path, Q.Q4_K, overrides=Q4_K_M) if mix == "Q4_K_M" else write_quantised(path, Q[mix])
    ours = load_model(str(path), torch.float16, "cpu")
    layers = [m for m in ours.model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    kernels = {m.quant_method.kernel for m in layers}
    # Q4_K_M: all-Q4_K layers keep Q4_K's own scales (TRITON_K), the qkv runs apart (None), Q6_K in the k-bit form
    assert kernels == ({None, int4.Int4Kernel.TRITON_K, bits.BitsKernel.TRITON} if mix == "Q4_K_M" else {bits.BitsKernel.TRITON})
    tables = [ours.model.model.embed_tokens, ours.model.lm_head] if mix == "Q4_K_M" else []
    assert all(isinstance(t.quant, PackedRows) and t.weight.numel() == 0 for t in tables)  # no dense copy
    resident = sum(resident_weight_bytes(m) for m in [*layers, *tables])
    quantised = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type not in (Q.F32, Q.F16)]
    assert len(quantised) == 7 * 2 + len(tables)  # every projection of both blocks (and the tables)
    file_bytes = sum(int(t.n_bytes) for t in quantised)
    # Measured: Q5_0 / Q5_1 / Q8_0 1.000x, Q5_K 1.091x, Q6_K 1.067x, Q4_K_M (tables too) 1.044x (1.096x when
    # Q4_K took int4's form, 1.111x; its own scales are 1.028x).
    assert abs(resident - file_bytes) <= 0.1 * file_bytes, (resident, file_bytes)


def test_a_mixed_qkv_splits_per_rank_under_tensor_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K q/k beside a Q6_K v at tp 2 (in the GPU forms, installed on CPU tensors): each rank holds its
    heads' rows, one Q4_K run (its own scales) then one k-bit run, and together they are exactly the file's weights."""
    from agentbox.kernels.dequant import dequant_bits, dequant_int4k
    from agentbox.layers.linear import QKVParallelLinear
    from agentbox.layers.quant import QuantConfig, QuantMethod, process_weights_after_loading, quant_context
    from agentbox.parallel.state import set_tp_state

    monkeypatch.setattr(bits, "default_kernel", lambda device: bits.BitsKernel.TRITON)
    monkeypatch.setattr(int4, "default_cpu_kernel", lambda: int4.Int4Kernel.TRITON)
    rng = np.random.default_rng(4)
    shapes = {"q": (Q.Q4_K, 256), "k": (Q.Q4_K, 128), "v": (Q.Q6_K, 128)}  # 4 heads, 2 KV heads of 64
    blocks = {s: GGUFBlocks(t, (n, 512), quantise(rng.normal(0, 0.05, (n, 512)).astype(np.float32), t, rng))
              for s, (t, n) in shapes.items()}
    full = {s: b.dequantize() for s, b in blocks.items()}
    try:
        for rank in range(2):
            set_tp_state(rank, 2)
            with quant_context(QuantConfig(QuantMethod.GGUF)):
                layer = QKVParallelLinear(512, 64, 4, 2)
            for s, b in blocks.items():
                load_weight(layer.weight, b, s)
            process_weights_after_loading(layer)
            int4_run, bits_run = layer.segments
            assert int4_run.int4_kernel is int4.Int4Kernel.TRITON_K and bits_run.bits_kernel is bits.BitsKernel.TRITON
            qk = dequant_int4k(int4_run.qweight_t, int4_run.sc_t, int4_run.mn_t, int4_run.dd_t).t()
            v = dequant_bits(bits_run.qweight_t, bits_run.qhigh_t, bits_run.scale_t, None, 16, 6).t()
            heads = slice(rank * 128, rank * 128 + 128)
            kv = slice(rank * 64, rank * 64 + 64)
            assert torch.equal(qk, torch.cat([full["q"][heads], full["k"][kv]]))
            assert torch.equal(v, full["v"][kv])
    finally:
        set_tp_state(0, 1)
