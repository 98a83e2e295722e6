"""kernels/wbits.py (and so `load_bits_tile`) against its torch twin, for every width with and without offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from model_harness import PagedRunner
from test_quant_gguf import PROMPT, Q4_K_M, quantise, twin, write_quantised

from agentbox.kernels.dequant import dequant_bits, pack_bits
from agentbox.kernels.wbits import wbits_matmul, wbits_matmul_ref
from agentbox.layers.quant import bits, int4
from agentbox.layers.weight_loading import load_weight
from agentbox.models.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("m", "n", "k", "group", "bits", "has_offset", "dtype"), [
    (1, 64, 64, 32, 5, False, torch.float32),  # Q5_0
    (3, 40, 64, 32, 5, True, torch.float16),  # Q5_1 / Q5_K, N not a tile multiple
    (5, 72, 96, 16, 6, False, torch.float32),  # Q6_K
    (2, 64, 64, 32, 8, False, torch.float16),  # Q8_0
    (17, 24, 32, 16, 8, True, torch.float32),  # a promoted mixed layer; M over one tile
])
def test_wbits_matches_its_twin(
    m: int, n: int, k: int, group: int, bits: int, has_offset: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(bits * 10 + m)
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(k // group, n, generator=gen) * 0.01).to(dtype)
    offset = (torch.randn(k // group, n, generator=gen) * 0.05).to(dtype) if has_offset else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    qweight, qhigh = pack_bits(q, bits)
    ref = wbits_matmul_ref(x, qweight, qhigh, scale, offset, group, bits)
    s = scale.float().repeat_interleave(group, 0)
    w = q.float() * s + offset.float().repeat_interleave(group, 0) if has_offset else (q.float() - 2 ** (bits - 1)) * s
    torch.testing.assert_close(dequant_bits(qweight, qhigh, scale, offset, group, bits), w)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, qweight, qhigh, scale, offset)]
    got = wbits_matmul(*dev, group, bits)
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=tol, rtol=tol)


def test_wbits_names_a_bad_shape() -> None:
    qweight, qhigh = pack_bits(torch.zeros(64, 8, dtype=torch.uint8), 6)
    scale = torch.ones(4, 8)
    with pytest.raises(ValueError, match="qhigh"):
        wbits_matmul(torch.zeros(1, 64, device=DEVICE), qweight.to(DEVICE), qhigh[:1].to(DEVICE), scale.to(DEVICE), None, 16, 6)


@pytest.fixture
def triton_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bits, "default_kernel", lambda device: bits.BitsKernel.TRITON)
    monkeypatch.setattr(int4, "default_cpu_kernel", lambda: int4.Int4Kernel.TRITON)


@pytest.mark.parametrize("types", [
    (Q.Q5_0, Q.Q5_0), (Q.Q5_1, Q.Q5_1), (Q.Q8_0, Q.Q8_0), (Q.Q5_K, Q.Q5_K), (Q.Q6_K, Q.Q6_K),
    (Q.Q4_K, Q.Q6_K),  # Q4_K_M's qkv: an int4 run, then a k-bit run
    (Q.Q5_0, Q.Q5_1),  # one 5-bit run: the symmetric shard gets an explicit offset
], ids=lambda t: "+".join(q.name for q in t))
@pytest.mark.usefixtures("triton_forms")
def test_a_gguf_layer_runs_the_kernels(types: tuple[Q, Q]) -> None:
    """A merged GGUF layer (two shards, with a bias) through wbits / w4a16 against its dequantised weight."""
    from agentbox.layers.linear import MergedColumnParallelLinear
    from agentbox.layers.quant import QuantConfig, QuantMethod, process_weights_after_loading, quant_context
    from agentbox.layers.quant.gguf import GGUFBlocks

    rng = np.random.default_rng(5)
    with quant_context(QuantConfig(QuantMethod.GGUF)):
        layer = MergedColumnParallelLinear(256, [64, 32], bias=True)
    blocks = [GGUFBlocks(t, (n, 256), quantise(rng.normal(0, 0.05, (n, 256)).astype(np.float32), t, rng))
              for t, n in zip(types, (64, 32), strict=True)]
    for shard, b in enumerate(blocks):
        load_weight(layer.weight, b, shard)
    layer.bias.data.copy_(torch.randn(96))
    dense = torch.cat([b.dequantize() for b in blocks])
    process_weights_after_loading(layer)
    if types[0] is Q.Q4_K:  # the Q4_K run at the file's bytes (w4k), the Q6_K run in the k-bit form
        assert layer.quant_method.kernel is None and len(layer.segments) == 2
        assert layer.segments[0].int4_kernel is int4.Int4Kernel.TRITON_K
    else:
        assert layer.quant_method.kernel is bits.BitsKernel.TRITON
        assert (layer.offset_t is None) == all(t in (Q.Q5_0, Q.Q8_0, Q.Q6_K) for t in types)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, x @ dense.t() + layer.bias, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("triton_forms")
def test_a_q4_k_m_model_runs_the_kernel_path(tmp_path: Path) -> None:
    """A whole Q4_K_M-mixed GGUF model through wbits and w4a16 (the CUDA path, here under the interpreter):
    logits and the next token as transformers on the dequantised twin. Every type's model through the
    dense path is in tests/test_quant_gguf.py; one step here, as the interpreter takes seconds per step."""
    path = tmp_path / "tiny.gguf"
    state = write_quantised(path, Q.Q4_K, overrides=Q4_K_M)
    ours = load_model(str(path), torch.float32, "cpu")
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert [getattr(s, "bits_kernel", None) for s in qkv.segments] == [None, bits.BitsKernel.TRITON]
    assert ours.model.model.layers[0].mlp.down_proj.quant_method.kernel is bits.BitsKernel.TRITON
    embed, head = ours.model.model.embed_tokens.quant, ours.model.lm_head.quant  # Q4_K and Q6_K tables
    assert embed.int4_kernel is int4.Int4Kernel.TRITON and head.bits_kernel is bits.BitsKernel.TRITON
    with torch.no_grad():
        expected = twin(state)(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours).step({0: PROMPT})[0]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    assert int(got[-1].argmax()) == int(expected[-1].argmax())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.usefixtures("triton_forms")
def test_a_gguf_vocabulary_table_stays_packed_per_rank(qtype: Q) -> None:
    """A table whose rows do not divide by tp (padded with zero rows): each rank's lookups are the file's rows
    and its head logits the dense product, from the packed form (no dense copy)."""
    from agentbox.layers.embedding import ParallelLMHead
    from agentbox.layers.quant.gguf import GGUFBlocks
    from agentbox.layers.quant.quant_rows import PackedRows
    from agentbox.parallel.state import set_tp_state

    rng = np.random.default_rng(6)
    table = GGUFBlocks(qtype, (99, 256), quantise(rng.normal(0, 0.05, (99, 256)).astype(np.float32), qtype, rng))
    full = torch.cat([table.dequantize(), torch.zeros(1, 256)])  # 50 rows a rank: rank 1's last is padding
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    try:
        for rank in range(2):
            set_tp_state(rank, 2)
            head = ParallelLMHead(99, 256)
            load_weight(head.weight, table)
            assert isinstance(head.quant, PackedRows) and head.weight.numel() == 0
            mine = full[rank * 50 : rank * 50 + 50]
            ids = torch.tensor([[0, 49, 7]])
            assert torch.equal(head.quant.rows(ids), mine[ids])
            torch.testing.assert_close(head.quant.matmul(x), x @ mine.t(), atol=1e-4, rtol=1e-4)
    finally:
        set_tp_state(0, 1)


WBITS_CUBIN = """
import sys
sys.path.insert(0, sys.argv[1])
from cubin_compile import compile_for
from agentbox.kernels._quant_triton import dequant_gemm_kernel
ptrs = dict(x_ptr="*bf16", w_ptr="*i32", h_ptr="*i32", s_ptr="*bf16", o_ptr="*bf16", out_ptr="*bf16")
for bits, has_offset, group in ((5, True, 32), (6, False, 16), (8, False, 32)):
    consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=group, FORMAT=1, BITS=bits, HAS_OFFSET=has_offset)
    print(f"wbits {bits}-bit sm_80: {compile_for(dequant_gemm_kernel, ptrs, consts, 80)} B of cubin")
q4k = dict(ptrs, h_ptr="*fp16", s_ptr="*u8", o_ptr="*u8")  # w4k: Q4_K's own scales (FORMAT 5, INT4_K)
consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, FORMAT=5, BITS=0, HAS_OFFSET=True)
print(f"w4k sm_80: {compile_for(dequant_gemm_kernel, q4k, consts, 80)} B of cubin")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the tests above compile it for this GPU")
def test_wbits_compiles_to_cubin_without_a_gpu() -> None:
    """The interpreter runs Python, not the compiler: build the real sm_80 binary of each width too (bf16)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", WBITS_CUBIN, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("B of cubin") == 4, done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("bits", "group", "has_offset"), [(5, 32, False), (5, 32, True), (6, 16, False), (8, 32, False)])
@torch.inference_mode()
def test_wbits_bf16_at_a_real_shape(bits: int, group: int, has_offset: bool) -> None:
    """bf16 (the interpreter's bf16 tl.dot is wrong, so CUDA only) at Qwen3-8B's hidden size, decode and a
    prefill chunk, against the twin's fp32 products."""
    k, n = 4096, 4096
    q = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, device="cuda")
    qweight, qhigh = pack_bits(q, bits)
    scale = (torch.rand(k // group, n, device="cuda") * 0.01).to(torch.bfloat16)
    offset = (torch.randn(k // group, n, device="cuda") * 0.05).to(torch.bfloat16) if has_offset else None
    for m in (1, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = wbits_matmul_ref(x.float(), qweight, qhigh, scale, offset, group, bits)
        got = wbits_matmul(x, qweight, qhigh, scale, offset, group, bits).float()
        torch.testing.assert_close(got, ref, atol=0.05 * float(ref.abs().max()), rtol=2e-2)
