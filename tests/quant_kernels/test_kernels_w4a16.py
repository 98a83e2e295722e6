"""kernels/w4a16.py against its torch twin, and the twin against the canonical int4 reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from model_harness import PagedRunner
from quant_checkpoints import PROMPT, write_int4
from test_quant_gguf import quantise

from agentbox.kernels.dequant import dequant_int4k
from agentbox.kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref, w4k_matmul, w4k_matmul_ref
from agentbox.layers.quant import int4
from agentbox.layers.quant.gguf import GGUFBlocks, q4k_scales
from agentbox.layers.quant.int4 import dequantize, pack_rows_int32
from agentbox.models.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("m", "n", "k", "group", "dtype"), [
    (1, 64, 128, 32, torch.float32), (5, 96, 256, 128, torch.float16), (17, 40, 64, 32, torch.float32),
])
def test_w4a16_matches_its_twin(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02
    offset = -8 * scale + torch.randn(n, k // group, generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen).to(dtype)
    qweight = pack_rows_int32(q.t().contiguous())
    s_t, o_t = scale.t().contiguous().to(dtype), offset.t().contiguous().to(dtype)
    ref = w4a16_matmul_ref(x, qweight, s_t, o_t, group)
    dense = x.float() @ dequantize(q, s_t.t().float(), o_t.t().float()).t()
    torch.testing.assert_close(ref.float(), dense, atol=1e-2, rtol=1e-2)
    got = w4a16_matmul(x.to(DEVICE), qweight.to(DEVICE), s_t.to(DEVICE), o_t.to(DEVICE), group)
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=tol, rtol=tol)


def test_awq_layers_run_the_kernel_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole AWQ model through the w4a16 kernel (the CUDA path; here under the interpreter)."""
    hf = write_int4(tmp_path, "awq")
    monkeypatch.setattr(int4, "default_cpu_kernel", lambda: int4.Int4Kernel.TRITON)
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    assert ours.model.model.layers[0].mlp.down_proj.int4_kernel is int4.Int4Kernel.TRITON
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(ours).step({0: PROMPT})[0], expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (7, torch.float16)])
def test_w4k_reads_q4_k_scales_exactly(m: int, dtype: torch.dtype) -> None:
    """GGUF Q4_K at its file's bytes: the twin is exactly gguf's dequantisation, the kernel its twin; the layer
    form takes 0.578 bytes a weight (the file 0.5625; a bf16 scale and offset per 32 would take 0.625)."""
    rng = np.random.default_rng(3)
    n, k = 48, 512
    blocks = GGUFBlocks(Q.Q4_K, (n, k), quantise(np.zeros((n, k), np.float32), Q.Q4_K, rng))
    q, sc, mn, dd = q4k_scales(blocks)
    layer = torch.nn.Module()
    int4.install_k(layer, q, sc, mn, dd, torch.device("cpu"))
    assert sum(p.nbytes for p in layer.parameters()) == n * k * 0.578125
    twin = dequant_int4k(layer.qweight_t, layer.sc_t, layer.mn_t, layer.dd_t)
    torch.testing.assert_close(twin.t(), blocks.dequantize(), atol=0, rtol=0)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = w4k_matmul_ref(x, layer.qweight_t, layer.sc_t, layer.mn_t, layer.dd_t)
    dev = [t.to(DEVICE) for t in (x, layer.qweight_t, layer.sc_t, layer.mn_t, layer.dd_t)]
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(w4k_matmul(*dev).cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_w4k_bf16_at_a_real_shape() -> None:
    """bf16 (the interpreter's bf16 tl.dot is wrong, so CUDA only) at Gemma 4 31B's hidden size, decode and a
    prefill chunk, against the twin's fp32 products."""
    k, n = 5376, 4096
    qweight = pack_rows_int32(torch.randint(0, 16, (k, n), dtype=torch.uint8)).cuda()
    sc, mn = (torch.randint(0, 64, (k // 32, n), dtype=torch.uint8, device="cuda") for _ in range(2))
    dd = (torch.rand(k // 256, n, 2, device="cuda") * 1e-3).half()
    for m in (1, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = w4k_matmul_ref(x.float(), qweight, sc, mn, dd)
        got = w4k_matmul(x, qweight, sc, mn, dd).float()
        torch.testing.assert_close(got, ref, atol=0.05 * float(ref.abs().max()), rtol=2e-2)
