"""kernels/w8a16.py (block FP8, weight-only) against its torch twin, and a whole FP8 model through it with
its fp8 bytes resident."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner
from quant_checkpoints import PROMPT, write_fp8

from agentbox.kernels.w8a16 import w8a16_block_matmul, w8a16_block_matmul_ref
from agentbox.layers.quant import QuantMethod, resident_weight_bytes
from agentbox.layers.quant.fp8 import FP8Kernel
from agentbox.models import loader

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(1, 128, 256, torch.float32), (9, 200, 128, torch.float16)])
def test_w8a16_matches_its_twin(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn)  # normals and subnormals both
    w[0, :8] = torch.tensor([0.0, -0.0, 2**-9, -(2**-7), 448.0, -448.0, 1.5, 0.001953125]).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = w8a16_block_matmul_ref(x, w, scale, (128, 128))
    got = w8a16_block_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), (128, 128))
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=tol, rtol=tol)


def test_fp8_model_through_the_kernel_keeps_fp8_resident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = write_fp8(tmp_path)
    real = loader.quant_config
    monkeypatch.setattr(loader, "quant_config", lambda src, cfg, cls=None: replace(real(src, cfg, cls), kernel=FP8Kernel.TRITON))
    ours = loader.load_model(str(tmp_path), torch.float32, "cpu")
    layers = [m for m in ours.model.modules() if getattr(getattr(m, "quant_method", None), "kind", None)
              is QuantMethod.FP8_BLOCK]
    assert len(layers) == 8 and all(m.weight.dtype is torch.float8_e4m3fn for m in layers)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(ours).step({0: PROMPT})[0], expected, atol=1e-3, rtol=1e-3)
    params = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("_proj.weight"))
    file_bytes = params + params // (128 * 128) * 4  # e4m3 bytes + one float32 scale per block
    got = sum(resident_weight_bytes(m) for m in layers)
    assert abs(got - file_bytes) <= 0.1 * file_bytes
