"""The k-bit form (bits 5, 6, 8): GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K as codes + scale (+ offset) exactly
equal to gguf's dequantize, and its packing for the kernels (kernels/dequant.py) lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from agentbox.kernels.dequant import dequant_bits, pack_bits, unpack_bits
from gguf import GGMLQuantizationType
from test_quant_gguf import quantise

from agentbox.layers.quant.gguf import BITS_TYPES, GGUFBlocks, bits_groups

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
