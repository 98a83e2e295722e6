"""A decode step through kernels/cpu_decode.c (one C call per layer) against the torch layers it replaces, over an
fp32 or an fp16 KV pool (the default CPU one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner
from quant_checkpoints import CONFIG, PROMPT, quantise_saved, write_int4
from top_tokens import assert_top_tokens_agree
from transformers import AutoModelForCausalLM, Qwen3Config

from agentbox.config import EngineConfig
from agentbox.engine.exec import cpu_decode
from agentbox.engine.exec.runner import ModelRunner
from agentbox.engine.exec.step_inputs import StepInputs
from agentbox.kernels import cpu_gemv
from agentbox.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="CPU kernels unavailable")


def _decode_logits(loaded: LoadedModel, prompts: dict[int, list[int]], steps: list[dict[int, int]],
                   kv_dtype: torch.dtype | None = None) -> list[dict[int, torch.Tensor]]:
    runner = PagedRunner(loaded, num_pages=48, page_size=16, kv_dtype=kv_dtype)
    runner.step(prompts)  # prefill: the torch layers either way
    return [runner.step({s: [t] for s, t in tokens.items()}) for tokens in steps]


@pytest.mark.slow
def test_fused_decode_matches_the_torch_layers(smollm2_fast: LoadedModel) -> None:
    assert cpu_decode.eligible(smollm2_fast.model.model)
    gen = torch.Generator().manual_seed(0)
    prompts = {0: torch.randint(100, 40000, (37,), generator=gen).tolist(), 1: torch.randint(100, 40000, (5,), generator=gen).tolist()}
    steps = [{0: int(a), 1: int(b)} for a, b in torch.randint(100, 40000, (12, 2), generator=gen)]
    fused = _decode_logits(smollm2_fast, prompts, steps)
    with cpu_decode.disabled():
        eager = _decode_logits(smollm2_fast, prompts, steps)
    for f, e in zip(fused, eager, strict=True):
        for s in (0, 1):
            # The same matmul kernel; RMSNorm / softmax summation order differ, and int8 rounding of the
            # activations can turn a last-bit difference into one step of a code. Measured 1-5 % against the
            # AVX2 attention build, up to 12 % at one position against the AVX-512 one (its 16-lane sums alone
            # move the torch layers' logits by up to 9.6 % there); a wrong rope or mask is ~100 %.
            assert (f[s] - e[s]).abs().max() < 0.15 * e[s].abs().max()
    got = torch.stack([f[s] for f in fused for s in (0, 1)])
    expected = torch.stack([e[s] for e in eager for s in (0, 1)])
    # Random prompt tokens: many near-ties (measured: 8 of 24 positions decided); where the top two are
    # further apart than the difference, the top token is the same.
    assert_top_tokens_agree(got, expected, max_err=0.15 * expected.abs().max().item(), min_decided=0.15)


def _qwen3(path: Path) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(**{**CONFIG, "architectures": ["Qwen3ForCausalLM"], "head_dim": 64})
    hf = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    quantise_saved(path, "gptq", group=128)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_decode_covers_qkv_bias_and_qk_norm(family: str, tmp_path: Path) -> None:
    """Qwen2's qkv bias and Qwen3's per-head q/k RMSNorm in the C layer: the same logits as the torch
    layers (GPTQ int4 checkpoints, so every linear runs the CPU kernel)."""
    path = tmp_path / family
    if family == "qwen2":
        write_int4(path, "gptq", group=128)
    else:
        _qwen3(path)
    loaded = load_model(str(path), torch.float32, "cpu")
    attn = loaded.model.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == (family == "qwen2") and attn.qk_norm == (family == "qwen3")
    assert cpu_decode.eligible(loaded.model.model)
    prompts = {0: PROMPT, 1: PROMPT[:5]}
    steps = [{0: 7 + i, 1: 90 - i} for i in range(6)]
    fused = _decode_logits(loaded, prompts, steps)
    with cpu_decode.disabled():
        eager = _decode_logits(loaded, prompts, steps)
    for f, e in zip(fused, eager, strict=True):
        for s in (0, 1):
            # Measured up to 0.9 % of the logit range (int8-rounded activations flip a step of a code
            # where the two paths' last bits differ); without the q/k norm it is 10-60 %.
            assert (f[s] - e[s]).abs().max() < 0.03 * e[s].abs().max()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_verify_rows_are_one_row_decodes_bit_for_bit(kv_dtype: torch.dtype, tmp_path: Path) -> None:
    """Two sequences' several rows in one step (a verify each; the C attention reads each block of keys once
    for a sequence's rows and a GQA group's heads, rows ending at their own positions, one across a page
    boundary) leave exactly the hidden states of decoding the same tokens one step at a time; over an fp16
    pool too (each block widened once for every row that shares it)."""
    _qwen3(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    assert cpu_decode.eligible(loaded.model.model)
    seen: list[torch.Tensor] = []  # the C layers' last hidden state and residual (the LM head's sgemm
    # rounds by its row count, so the logits are no test of the layers' bits)
    loaded.model.model.norm.register_forward_pre_hook(lambda _, args: seen.append(torch.cat(args[:2], 1).clone()))
    prompts = {0: PROMPT * 2, 1: PROMPT[:5]}
    drafts = {0: [7 + i for i in range(10)], 1: [90, 91, 92, 93]}  # sequence 0: positions 24-33 (pages of 16)
    together = PagedRunner(loaded, num_pages=16, page_size=16, kv_dtype=kv_dtype)
    together.step(prompts)
    together.step(drafts)
    got = seen[-1]
    alone = PagedRunner(loaded, num_pages=16, page_size=16, kv_dtype=kv_dtype)
    alone.step(prompts)
    for i in range(10):
        alone.step({s: [d[i]] for s, d in drafts.items() if i < len(d)})
    steps = seen[-10:]
    assert torch.equal(got[:10], torch.stack([steps[i][0] for i in range(10)]))
    assert torch.equal(got[10:], torch.stack([steps[i][1] for i in range(4)]))


def test_fused_decode_over_an_fp16_pool(tmp_path: Path) -> None:
    """The C layer stores k/v into an fp16 pool and widens it to attend: the torch layers' logits over the same
    fp16 pool (their store rounds with .to(fp16), cpu_attention.c widens), and close to the fp32 pool's."""
    _qwen3(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    prompts = {0: PROMPT * 2, 1: PROMPT[:5]}
    steps = [{0: 7 + i, 1: 90 - i} for i in range(6)]
    fused = _decode_logits(loaded, prompts, steps, torch.float16)
    with cpu_decode.disabled():
        eager = _decode_logits(loaded, prompts, steps, torch.float16)
    wide = _decode_logits(loaded, prompts, steps, torch.float32)
    for f, e, w in zip(fused, eager, wide, strict=True):
        for s in (0, 1):
            # as over fp32 (test_fused_decode_covers_qkv_bias_and_qk_norm); fp16 bits read as fp32 are ~100 %
            assert (f[s] - e[s]).abs().max() < 0.03 * e[s].abs().max()
            assert (f[s] - w[s]).abs().max() < 0.03 * w[s].abs().max()


def test_kv_store_rounds_to_nearest_even_as_torch() -> None:
    """cpu_decode.c's KV store (the fused Llama and hybrid layers') writes torch's .half() bits: ties to even,
    subnormals, overflow to inf; truncation differs in about half of these values, a raw fp32 copy in all."""
    gen = torch.Generator().manual_seed(3)
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(2 + 2**-10), 1e-6, -3e-7, 7e4, 65519.0, 65520.0])
    src = torch.cat([ties, torch.randn(248, generator=gen) * 10.0 ** torch.randint(-5, 4, (248,), generator=gen)])
    lib = cpu_gemv._lib()
    cache = torch.zeros(2 * 256, dtype=torch.float16)
    lib.ab_store_kv(cache.data_ptr(), 1, 256, src.data_ptr(), 256)
    assert torch.equal(cache[256:].view(torch.int16), src.half().view(torch.int16))
    assert not cache[:256].any()  # nothing before `at`
    wide = torch.zeros(256)
    lib.ab_store_kv(wide.data_ptr(), 0, 0, src.data_ptr(), 256)
    assert torch.equal(wide, src)


def _runner_step(runner: ModelRunner, tokens: list[int], start: int, pages: list[int]) -> torch.Tensor:
    """One step of one sequence (row 0 of the page table) through the engine's runner: its new tokens from
    position `start`, its pages written first. Returns the logits of its last token."""
    ps = runner.page_size
    end = start + len(tokens)
    cols = -(-end // ps)
    return runner.execute(StepInputs(
        input_ids=torch.tensor(tokens), positions=torch.arange(start, end),
        slot_mapping=torch.tensor([pages[p // ps] * ps + p % ps for p in range(start, end)]),
        query_lens=[len(tokens)], kv_lens=[end], table_rows=torch.tensor([0]),
        page_updates=torch.tensor([[0, c, pages[c]] for c in range(cols)]).reshape(-1, 3),
        sample_rows=torch.tensor([len(tokens) - 1]), num_table_cols=cols,
    ))[0]


@pytest.mark.slow
def test_the_engine_runner_picks_the_fused_decode(smollm2_path: Path, smollm2_fast: LoadedModel, smollm2_loaded: LoadedModel) -> None:
    """The runner, not the model, chooses the fused layers: for a decode step of the default CPU path (the
    harness's fused logits, not the torch layers'), never for the exact path (its layers are dequantised)."""
    config = EngineConfig(model=str(smollm2_path), num_pages=8, page_size=16, device="cpu", attention="torch")
    assert ModelRunner(config, loaded=smollm2_loaded).cpu_decode is None
    runner = ModelRunner(config, loaded=smollm2_fast)
    assert runner.cpu_decode is not None and runner.kv_cache.dtype == torch.float16  # the default CPU pool
    prompt, pages = PROMPT * 3, [3, 1, 5, 2]
    _runner_step(runner, prompt, 0, pages)  # prefill: the torch layers
    got = _runner_step(runner, [42], len(prompt), pages)
    fused = _decode_logits(smollm2_fast, {0: prompt}, [{0: 42}], torch.float16)[0][0][0]
    with cpu_decode.disabled():
        eager = _decode_logits(smollm2_fast, {0: prompt}, [{0: 42}], torch.float16)[0][0][0]
    scale = eager.abs().max()
    assert (fused - eager).abs().max() > 1e-4 * scale  # the two paths differ in their last bits (int8 rounding)
    assert (got - fused).abs().max() < 1e-5 * scale  # the same C layers on the same cache contents


@pytest.mark.parametrize("isa", list(cpu_gemv.Isa), ids=lambda i: i.value)
def test_every_variant_this_cpu_runs_gives_the_avx2_decode_bits(isa: cpu_gemv.Isa, tmp_path: Path) -> None:
    """The whole fused layer (norms, rotary, paged attention, SiLU and the 4-bit products), not only the products:
    each variant's build leaves the AVX2 build's hidden states bit for bit, for a decode and a verify's rows."""
    if not isa.cpu_flags <= cpu_gemv.cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(isa.cpu_flags - cpu_gemv.cpu_flags()))}")
    _qwen3(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    assert cpu_decode.eligible(loaded.model.model)
    seen: list[torch.Tensor] = []
    loaded.model.model.norm.register_forward_pre_hook(lambda _, args: seen.append(torch.cat(args[:2], 1).clone()))

    def run() -> list[torch.Tensor]:
        seen.clear()
        runner = PagedRunner(loaded, num_pages=16, page_size=16)
        runner.step({0: PROMPT * 2, 1: PROMPT[:5]})
        runner.step({0: [7], 1: [90]})  # a decode
        runner.step({0: [8 + i for i in range(9)], 1: [91, 92, 93]})  # a verify's rows, across a page boundary
        return seen[1:]

    with cpu_gemv.use_isa(cpu_gemv.Isa.AVX2):
        reference = run()
    with cpu_gemv.use_isa(isa):
        got = run()
    assert len(got) == 2
    for g, r in zip(got, reference, strict=True):
        assert torch.equal(g, r)
