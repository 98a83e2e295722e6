"""The Qwen3.5 hybrid's decode through kernels/cpu_hybrid.c (one C call per layer, fp16 weights read as fp16)
against the torch layers it replaces, and the fp16 matmul against its torch twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hybrid_models import configs, save_hybrid
from model_harness import PagedRunner

from agentbox.engine.exec import cpu_hybrid
from agentbox.kernels import cpu_f16, cpu_gemv
from agentbox.layers.quant import int4
from agentbox.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="CPU kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, cpu_f16.MAX_ROWS + 1])
def test_f16_matmul_matches_its_twin(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 144, generator=gen)
    w = (0.1 * torch.randn(37, 144, generator=gen)).to(dtype)  # 144 = 4 x 32 + 16: both column loops
    got, expected = cpu_f16.f16_matmul(x, w), cpu_f16.f16_matmul_ref(x, w)
    assert got.shape == expected.shape == (rows, 37)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # the same products, summed in another order


@pytest.fixture(scope="module")
def hybrid_f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5_f16")
    save_hybrid(configs()["qwen3_5"], path).half().save_pretrained(path)  # every tensor fp16, as an f16 GGUF
    return path


def _decode(loaded: LoadedModel, steps: list[dict[int, list[int]]],
            kv_dtype: torch.dtype | None = None) -> list[dict[int, torch.Tensor]]:
    runner = PagedRunner(loaded, num_pages=48, page_size=4, kv_dtype=kv_dtype)
    runner.step({0: list(range(3, 40)), 1: [9, 8, 7, 6, 5]})  # prefill: the torch layers either way
    return [runner.step(chunk) for chunk in steps]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_fused_hybrid_decode_matches_the_torch_layers(kv_dtype: torch.dtype, hybrid_f16: Path) -> None:
    """Over an fp32 pool and the default CPU one, fp16 (the gated attention's store rounds, its attention widens; the
    torch layers' store rounds with .to(fp16) and cpu_attention.c widens)."""
    loaded = load_model(str(hybrid_f16), torch.float32, "cpu")
    inner = loaded.model.fused_cpu_hybrid_target()
    assert inner is not None and cpu_hybrid.eligible(inner)
    assert loaded.model.language_model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.float16
    assert isinstance(PagedRunner(loaded).cpu_decode, cpu_hybrid.HybridCpuDecode)
    # decodes of both sequences, then an extend of one (the torch layers), then decodes from the state it left
    steps = [{0: [11 + i], 1: [70 - i]} for i in range(4)] + [{0: [1, 2, 3], 1: [44]}]
    steps += [{0: [20 + i], 1: [50 + i]} for i in range(3)]
    fused = _decode(loaded, steps, kv_dtype)
    with cpu_hybrid.disabled():
        eager = _decode(loaded, steps, kv_dtype)
    for f, e in zip(fused, eager, strict=True):
        for s in (0, 1):
            # The same fp32 products in another order: ~1e-6 of the largest logit. A wrong gate, decay, conv tap or
            # rope is of the order of the logits themselves.
            assert (f[s] - e[s]).abs().max() < 1e-4 * e[s].abs().max()


def test_a_bf16_checkpoint_is_read_as_stored_and_decodes_as_the_widened_model(tmp_path: Path) -> None:
    """A Hugging Face checkpoint's bf16 linears stay bf16 on the CPU (half the bytes a decode step streams), take the
    fused decode, and give the logits of the same checkpoint widened to fp32 at load (what --exact-cpu loads)."""
    save_hybrid(configs()["qwen3_5"], tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    kept = load_model(str(tmp_path), torch.float32, "cpu")
    assert kept.model.language_model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert kept.model.language_model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert isinstance(PagedRunner(kept).cpu_decode, cpu_hybrid.HybridCpuDecode)
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        widened = load_model(str(tmp_path), torch.float32, "cpu")
    assert widened.model.language_model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.float32
    steps = [{0: [11 + i], 1: [70 - i]} for i in range(3)] + [{0: [1, 2, 3], 1: [44]}]
    for f, e in zip(_decode(kept, steps), _decode(widened, steps), strict=True):
        for s in (0, 1):  # the same fp32 products (widening bf16 is exact) in another order
            assert (f[s] - e[s]).abs().max() < 1e-4 * e[s].abs().max()


def test_exact_cpu_keeps_fp32_weights_and_the_torch_layers(hybrid_f16: Path) -> None:
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):  # what --exact-cpu loads under
        loaded = load_model(str(hybrid_f16), torch.float32, "cpu")
    assert loaded.model.language_model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.float32
    assert PagedRunner(loaded).cpu_decode is None


def _verify_run(loaded: LoadedModel, kept: int) -> list[dict[int, torch.Tensor]]:
    runner = PagedRunner(loaded, num_pages=48, page_size=4)
    out = [runner.step({0: list(range(3, 30)), 1: [9, 8, 7]})]
    out.append(runner.step({0: [31], 1: [6]}))
    out.append(runner.step({0: [32, 33, 34, 35], 1: [5]}, verifies=frozenset({0})))  # sequence 0 verifies 3 drafts
    assert runner.state is not None
    runner.state.commit([(0, kept, 0)], None)  # what the sampler kept, as the runner commits it the next step
    runner.lens[0] -= 4 - kept
    out += [runner.step({0: [40 + i], 1: [60 + i]}) for i in range(3)]
    return out


@pytest.mark.parametrize("kept", [2, 4])
def test_fused_verify_stashes_what_the_torch_layers_stash(hybrid_f16: Path, kept: int) -> None:
    """A verify's slot is left as it was and its stash commits any prefix: the decodes after it match."""
    loaded = load_model(str(hybrid_f16), torch.float32, "cpu")
    fused = _verify_run(loaded, kept)
    with cpu_hybrid.disabled():
        eager = _verify_run(loaded, kept)
    for f, e in zip(fused[1:], eager[1:], strict=True):
        for s in (0, 1):
            assert (f[s] - e[s]).abs().max() < 1e-4 * e[s].abs().max()
