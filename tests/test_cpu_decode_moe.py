"""Qwen3-MoE decode steps through kernels/cpu_decode.c with its routed experts in C (kernels/cpu_moe.c) and its
linears in either CPU form (the k-bit rows of Q8_0 attention, the 4-bit tiles of Q4 experts, runs of both), against
the torch layers they replace, on tests/test_gguf_moe.py's tiny GGUF (Q4_0, Q4_1, Q4_K, Q4_K + Q6_K down, Q8_0
expert layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner
from moe_harness import PROMPT
from test_gguf_moe import twin, write_qwen3moe
from top_tokens import assert_top_tokens_agree

from agentbox.engine.exec import cpu_decode
from agentbox.kernels import cpu_attention, cpu_gemv
from agentbox.layers.experts import FusedMoE
from agentbox.layers.quant.cpu_parts import cpu_parts
from agentbox.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="CPU kernels unavailable")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3moe-decode") / "tiny.gguf"
    return path, twin(write_qwen3moe(path))


def _decode(loaded: LoadedModel, prompts: dict[int, list[int]], steps: list[dict[int, list[int]]]) -> list[dict[int, torch.Tensor]]:
    runner = PagedRunner(loaded, num_pages=32, page_size=16)
    runner.step(prompts)  # prefill: the torch layers either way
    return [runner.step(tokens) for tokens in steps]


def test_the_fused_decode_takes_qwen3_moe(tiny) -> None:  # noqa: ANN001
    loaded = load_model(str(tiny[0]), torch.float32, "cpu")
    assert cpu_decode.eligible(loaded.model.model)
    forms = {p.bits for layer in loaded.model.model.layers for p in cpu_parts(layer.self_attn.qkv_proj)}
    assert forms == {8}  # the file's Q8_0 attention: cpu_bits' rows
    experts = [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]
    assert [tuple(p.bits for p in m.method.cpu_parts(m)) for m in experts] == [(4, 4), (4, 4), (4, 4), (4, 6), (8, 8)]


@pytest.fixture
def fp32_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch layers' attention in fp32 as the C layers': on a CPU with AMX their prefill chunks would take the
    split-bf16 tile kernel (~1e-5 of a value off), which this chaotic tiny model grows to ~3 % of the logits."""
    monkeypatch.setattr(cpu_attention, "amx_available", lambda: False)


@pytest.mark.usefixtures("fp32_attention")
def test_decode_steps_match_the_torch_layers(tiny) -> None:  # noqa: ANN001
    path, _ = tiny
    loaded = load_model(str(path), torch.float32, "cpu")
    # prompts longer than MAX_QUERY: both prefills run the torch layers, so the two runs decode over the same cache
    prompts = {0: PROMPT * 3, 1: (PROMPT * 3)[::-1]}
    steps = [{0: [7 + i], 1: [90 - i]} for i in range(8)]
    fused = _decode(loaded, prompts, steps)
    with cpu_decode.disabled():
        eager = _decode(loaded, prompts, steps)
    for f, e in zip(fused, eager, strict=True):
        for s in (0, 1):
            # The same kernels, routing and expert order; the router's, RMSNorm's, softmax's and SiLU's last bits may
            # differ (C's sums and exp against torch's). Measured equal to 1e-5 of the logit range; a wrong expert,
            # weight, norm or rope is 10-100 %. (The tiny random model is chaotic: a cache that differs in its last
            # bits, as a short prompt prefilled through either path leaves it, moves later logits by up to 11 %.)
            assert (f[s] - e[s]).abs().max() < 1e-3 * e[s].abs().max()
    got = torch.stack([f[s] for f in fused for s in (0, 1)])
    expected = torch.stack([e[s] for e in eager for s in (0, 1)])
    assert_top_tokens_agree(got, expected, max_err=1e-3 * expected.abs().max().item(), min_decided=0.5)


@pytest.mark.usefixtures("fp32_attention")
def test_a_short_prompt_through_the_fused_layers(tiny) -> None:  # noqa: ANN001
    """A prompt of at most MAX_QUERY tokens runs the C layers as rows of one sequence (each expert over the rows
    routed to it): its logits are the torch layers'."""
    loaded = load_model(str(tiny[0]), torch.float32, "cpu")
    prompts = {0: PROMPT * 2, 1: PROMPT[:5]}
    fused = PagedRunner(loaded, num_pages=32, page_size=16).step(prompts)
    with cpu_decode.disabled():
        eager = PagedRunner(loaded, num_pages=32, page_size=16).step(prompts)
    for s in (0, 1):
        assert (fused[s] - eager[s]).abs().max() < 1e-2 * eager[s].abs().max()  # measured 0.2 %


def test_verify_rows_are_one_row_decodes_bit_for_bit(tiny) -> None:  # noqa: ANN001
    """Several rows of two sequences in one step (a verify each): each expert runs over the rows routed to it, and
    every row's hidden state is exactly that of decoding the same tokens one step at a time."""
    loaded = load_model(str(tiny[0]), torch.float32, "cpu")
    seen: list[torch.Tensor] = []  # the C layers' last hidden state and residual
    loaded.model.model.norm.register_forward_pre_hook(lambda _, args: seen.append(torch.cat(args[:2], 1).clone()))
    prompts = {0: PROMPT * 2, 1: PROMPT[:5]}
    drafts = {0: [7 + i for i in range(10)], 1: [90, 91, 92, 93]}
    together = PagedRunner(loaded, num_pages=16, page_size=16)
    together.step(prompts)
    together.step(drafts)
    got = seen[-1]
    alone = PagedRunner(loaded, num_pages=16, page_size=16)
    alone.step(prompts)
    for i in range(10):
        alone.step({s: [d[i]] for s, d in drafts.items() if i < len(d)})
    steps = seen[-10:]
    assert torch.equal(got[:10], torch.stack([steps[i][0] for i in range(10)]))
    assert torch.equal(got[10:], torch.stack([steps[i][1] for i in range(4)]))
