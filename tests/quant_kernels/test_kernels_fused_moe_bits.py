"""The fused-MoE kernel over k-bit experts (kernels/fused_moe_quant.py `fused_moe_bits`) against its torch
twin, on CPU under Triton's interpreter (fp32, fp16; small shapes): every GGUF width and group (Q5_0 /
Q5_1 / Q5_K at 5 bits and 32, Q6_K at 6 and 16, Q8_0 at 8 and 32), with and without an offset, and w13 /
w2 in different forms (a Q4_K_M layer: int4 gate/up, Q6_K down). The twin is first checked against the
form's definition written out here (w = q * scale + offset, or (q - 2^(bits-1)) * scale)."""

from __future__ import annotations

import pytest
import torch
from test_kernels_fused_moe_quant import DEVICE, act_for, biases, close, floats, routed, to

from agentbox.kernels.dequant import pack_bits
from agentbox.kernels.fused_moe import fused_moe_ref
from agentbox.kernels.fused_moe_quant import BitsWeights, fused_moe_bits, fused_moe_bits_ref
from agentbox.layers.quant.int4 import pack_rows_int32


def bits_experts(
    e: int, n: int, k: int, bits: int, group: int, has_offset: bool, dtype: torch.dtype, g: torch.Generator
) -> tuple[BitsWeights, torch.Tensor]:
    """(random experts of one projection on DEVICE, the dense [E, N, K] fp32 weights they stand for)."""
    q = torch.randint(0, 2**bits, (e, k, n), generator=g, dtype=torch.uint8)  # [E, K, N]: the kernels' order
    scale = (torch.rand(e, k // group, n, generator=g) * 0.02 + 0.002).to(dtype)
    offset = (torch.randn(e, k // group, n, generator=g) * 0.05).to(dtype) if has_offset else None
    s = scale.float().repeat_interleave(group, 1)
    if has_offset:
        dense = q.float() * s + offset.float().repeat_interleave(group, 1)  # type: ignore[union-attr]
    else:
        dense = (q.float() - 2 ** (bits - 1)) * s
    if bits == 4:  # the int4 form: no high bits
        qweight, qhigh = torch.stack([pack_rows_int32(q[i]) for i in range(e)]), None
    else:
        qweight, qhigh = pack_bits(q, bits)
    w = BitsWeights(*to(qweight), None if qhigh is None else qhigh.to(DEVICE), *to(scale),
                    None if offset is None else offset.to(DEVICE), group, bits)
    return w, dense.transpose(1, 2).contiguous()


CASES = [  # (t, e, k, h, inter, dtype, w13 form, w2 form, gpt-oss act + biases)
    (1, 4, 2, 64, 64, torch.float32, (5, 32, False), (5, 32, False), False),  # Q5_0
    (5, 4, 2, 64, 64, torch.float16, (5, 32, True), (5, 32, True), False),  # Q5_1 / Q5_K
    (3, 4, 2, 64, 48, torch.float32, (6, 16, False), (6, 16, False), False),  # Q6_K; N not a tile multiple
    (9, 4, 2, 64, 64, torch.float16, (8, 32, False), (8, 32, False), True),  # Q8_0, with biases
    (7, 4, 2, 64, 64, torch.float32, (4, 32, True), (6, 16, False), False),  # Q4_K_M: Q4_K gate/up, Q6_K down
    (2, 4, 2, 64, 32, torch.float32, (6, 16, True), (8, 32, False), False),  # a promoted mixed w13
]


@pytest.mark.parametrize(("t", "e", "k", "h", "inter", "dtype", "f13", "f2", "oai"), CASES)
def test_bits_experts_equal_their_twin(
    t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype,
    f13: tuple[int, int, bool], f2: tuple[int, int, bool], oai: bool,
) -> None:
    g = torch.Generator().manual_seed(t)
    w13, d13 = bits_experts(e, 2 * inter, h, *f13, dtype, g)
    w2, d2 = bits_experts(e, h, inter, *f2, dtype, g)
    x = torch.randn(t, h, generator=g).to(dtype)
    b13, b2 = biases(e, h, inter, dtype, g, oai)
    weights, ids = routed(t, e, k, seed=t)
    args = (x.to(DEVICE), w13, w2, weights, ids, act_for(oai), b13, b2)
    ref = fused_moe_bits_ref(*args)
    dense = fused_moe_ref(*to(x.float(), d13, d2), weights, ids, act_for(oai), *floats(b13, b2))
    close(ref, dense, dtype)
    close(fused_moe_bits(*args), ref, dtype)


def test_a_wrong_high_word_count_is_named() -> None:
    g = torch.Generator().manual_seed(0)
    w, _ = bits_experts(2, 32, 64, 6, 16, False, torch.float32, g)
    bad = BitsWeights(w.qweight, w.qhigh[:, :1], w.scale, None, 16, 6)  # type: ignore[index]
    x = torch.zeros(1, 64, device=DEVICE)
    weights, ids = routed(1, 2, 1, seed=0)
    with pytest.raises(ValueError, match=r"6-bit experts: .* qhigh \(2, 1, 32\)"):
        fused_moe_bits(x, bad, bad, weights, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_q4_k_m_experts_bf16_at_real_shapes() -> None:
    """Qwen3-Coder-30B-A3B's Q4_K_M layers (int4 gate/up in groups of 32, Q6_K down: 6 bits in groups of 16)
    in bf16 against the twin in fp32. Drawn on the device: a random int32 word is random codes."""
    from test_kernels_fused_moe_quant import QWEN3_30B

    torch.manual_seed(0)
    t, e, k, h, inter = (QWEN3_30B[n] for n in ("t", "e", "k", "h", "inter"))
    bf, dev = torch.bfloat16, "cuda"

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=dev)

    s13 = (torch.rand(e, h // 32, 2 * inter, device=dev) * 0.015 + 0.005).to(bf)
    w13 = BitsWeights(words(e, h // 8, 2 * inter), None, s13, (-8 * s13).to(bf), 32, 4)
    s2 = (torch.rand(e, inter // 16, h, device=dev) * 0.004 + 0.001).to(bf)
    w2 = BitsWeights(words(e, inter // 8, h), words(e, inter * 2 // 32, h), s2, None, 16, 6)
    x = torch.randn(t, h, device=dev, dtype=bf)
    weights, ids = routed(t, e, k, seed=3)
    close(fused_moe_bits(x, w13, w2, weights, ids), fused_moe_bits_ref(x.float(), w13, w2, weights, ids), bf)
