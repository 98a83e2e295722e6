"""kernels/nvfp4.py: the Triton W4A16 kernel against dequantise-then-matmul on odd shapes (K not a multiple of
the 64-wide K tile, N not of 16), under TRITON_INTERPRET=1 on CPU (this folder's conftest) or on CUDA. The
interpreter has no bfloat16 (numpy has none), so bf16 runs only in the gpu test; fp16 and fp32 run here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agentbox.kernels.nvfp4 import nvfp4_w4a16_matmul, nvfp4_w4a16_matmul_ref
from agentbox.layers.quant.nvfp4 import NvFp4Kernel
from agentbox.models import loader

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_nvfp4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every code, e4m3 scales from subnormal (2^-9) to 448, a different global multiplier per row."""
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 16, generator=gen) * 2.0).to(torch.float8_e4m3fn)
    scale[0, : min(4, k // 16)] = torch.tensor([2**-9, 0.0, 448.0, 0.013671875])[: min(4, k // 16)].to(torch.float8_e4m3fn)
    return packed, scale, torch.rand(n, generator=gen) * 0.1 + 1e-3


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype"),
    [(5, 37, 208, torch.float16), (1, 37, 208, torch.float32), (17, 70, 80, torch.float16), (3, 16, 64, torch.float32)],
)
def test_w4a16_matches_dequantise_then_matmul(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(k + n)
    packed, scale, gs = random_nvfp4(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = nvfp4_w4a16_matmul_ref(x, packed, scale, gs)
    got = nvfp4_w4a16_matmul(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), gs.to(DEVICE)).cpu()
    assert got.dtype is dtype and got.shape == (m, n)
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_shapes_that_do_not_fit_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    packed, scale, gs = random_nvfp4(8, 64, gen)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_w4a16_matmul(torch.randn(2, 72).to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), gs.to(DEVICE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU under the interpreter; on CUDA the gpu tests run it")
def test_nvfp4_model_through_the_kernel_keeps_fp4_resident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_harness import hf_logits, paged_logits, save_random
    from nvfp4_reference import quantise_saved
    from test_quant_nvfp4 import DENSE

    save_random(DENSE, tmp_path / "m")
    twin = quantise_saved(tmp_path / "m", "compressed-tensors")
    real = loader.quant_config
    monkeypatch.setattr(loader, "quant_config", lambda src, cfg, cls=None: replace(real(src, cfg, cls), kernel=NvFp4Kernel.TRITON_W4A16))
    ours = loader.load_model(str(tmp_path / "m"), torch.float32, "cpu")
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.kernel is NvFp4Kernel.TRITON_W4A16 and qkv.weight.dtype is torch.uint8
    torch.testing.assert_close(paged_logits(ours), hf_logits(twin), atol=1e-3, rtol=1e-3)


def test_the_gpu_check_block_runs_tiny_on_cpu() -> None:
    from agentbox.bench.gpu_nvfp4 import report

    r = report("cpu", shapes=((80, 37),), batches=(1, 3), dtype=torch.float32, reps=1, moe_shape=(4, 2, 32, 16),
               moe_tokens=(2,))
    assert not r["fp4_gemm"] and [c["m"] for c in r["cases"]] == [1, 3]
    assert all(c["w4a16_max_err"] < 1e-5 and c["w4a16_tok_s"] > 0 for c in r["cases"])
    assert [c["tokens"] for c in r["moe"]] == [2] and r["moe"][0]["max_err"] < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_w4a16_in_bf16_on_cuda() -> None:
    gen = torch.Generator().manual_seed(1)
    packed, scale, gs = random_nvfp4(4096, 4096 + 16, gen)
    x = torch.randn(32, 4096 + 16, generator=gen).bfloat16()
    ref = nvfp4_w4a16_matmul_ref(x, packed, scale, gs).float()
    got = nvfp4_w4a16_matmul(x.cuda(), packed.cuda(), scale.cuda(), gs.cuda()).float().cpu()
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp4_gemm_on_fp4_tensor_cores_is_close_to_w4a16() -> None:
    """W4A4 rounds the activations to e2m1 per 16: a few percent of each product, measured, not bit-equal."""
    from agentbox.layers.quant.formats import has_fp4_tensor_cores
    from agentbox.layers.quant.nvfp4 import flashinfer_fp4_available

    if not (has_fp4_tensor_cores(torch.cuda.get_device_capability()) and flashinfer_fp4_available()):
        pytest.skip("needs FP4 tensor cores (sm_100 / sm_120) and flashinfer")
    from agentbox.kernels.nvfp4 import fp4_gemm, prepare_fp4_gemm

    gen = torch.Generator().manual_seed(2)
    n, k = 4096, 4096
    packed, scale, gs = random_nvfp4(n, k, gen)
    x = torch.randn(32, k, generator=gen).bfloat16().cuda()
    w, sf = prepare_fp4_gemm(packed.cuda(), scale.cuda())
    input_scale = (x.float().abs().amax() / (6 * 448)).reshape(1)
    got = fp4_gemm(x, w, sf, gs.cuda(), input_scale, n).float()
    ref = nvfp4_w4a16_matmul(x, packed.cuda(), scale.cuda(), gs.cuda()).float()
    rel = (got - ref).norm() / ref.norm()
    print(f"fp4 gemm vs w4a16: relative error {rel:.4f}")
    assert rel < 0.15


@pytest.mark.parametrize(("t", "e", "k", "h", "inter", "dtype"), [(1, 4, 2, 64, 48, torch.float32), (9, 4, 2, 80, 32, torch.float16)])
def test_fused_moe_nvfp4_matches_its_twin(t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype) -> None:
    """The grouped fused-MoE kernel over NVFP4 experts (hidden 80: K not a multiple of the 32-wide MoE tile)."""
    from agentbox.kernels.fused_moe_quant import fused_moe_nvfp4, fused_moe_nvfp4_ref

    gen = torch.Generator().manual_seed(t)

    def experts(n: int, kk: int) -> tuple[torch.Tensor, ...]:
        per = [random_nvfp4(n, kk, gen) for _ in range(e)]
        return tuple(torch.stack([p[i] for p in per]).to(DEVICE) for i in range(3))

    w13, w2 = experts(2 * inter, h), experts(h, inter)
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEVICE)
    weights, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=gen), -1), k, dim=-1)
    args = (x, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    got, ref = fused_moe_nvfp4(*args).float().cpu(), fused_moe_nvfp4_ref(*args).float().cpu()
    tol = 1e-4 if dtype is torch.float32 else 0.02 * ref.abs().max().item()
    torch.testing.assert_close(got, ref, atol=tol, rtol=1e-4 if dtype is torch.float32 else 0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU under the interpreter; on CUDA the gpu tests run it")
def test_nvfp4_moe_model_through_the_fused_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny NVFP4 Qwen3-MoE whose experts take the fused kernel (forced on CPU) against the dequantised twin."""
    from moe_harness import hf_logits, paged_logits, save_random
    from nvfp4_reference import quantise_saved
    from test_quant_nvfp4 import MOE

    from agentbox.kernels import fused_moe_quant
    from agentbox.layers.experts import nvfp4 as nvfp4_experts

    save_random(MOE, tmp_path / "m")
    twin = quantise_saved(tmp_path / "m", "modelopt")
    calls: list[int] = []
    real = fused_moe_quant.fused_moe_nvfp4

    def counted(*a: object) -> torch.Tensor:
        calls.append(1)
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(nvfp4_experts, "kernel_runs", lambda x: True)
    monkeypatch.setattr(fused_moe_quant, "fused_moe_nvfp4", counted)
    ours = loader.load_model(str(tmp_path / "m"), torch.float32, "cpu")
    torch.testing.assert_close(paged_logits(ours), hf_logits(twin), atol=1e-3, rtol=1e-3)
    assert calls  # the experts went through the kernel
