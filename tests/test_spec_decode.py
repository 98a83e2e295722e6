"""Speculative decoding (engine/draft.py, engine/exec/verify.py): greedy output with drafts equals greedy
output without, token for token, on SmolLM2 (exact and default CPU paths) and tiny random dense and MoE
models; stops, max_tokens and the pool's pages hold inside an accepted run; the sampled rule keeps the
distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moe_harness import save_random
from transformers import LlamaConfig, Qwen3MoeConfig

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.draft import Drafter, longest_match
from agentbox.engine.exec.verify import sampled_prefix
from agentbox.engine.llm import LLM
from agentbox.engine.request import Request
from agentbox.engine.sampling import SamplingParams
from agentbox.kernels import cpu_gemv
from agentbox.models.loader import load_model

TEXT = (
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "def sub(a, b):\n    return a - b\n"
)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512)


def _run(loaded, path, spec: Speculative, prompts: list[list[int]], sp: SamplingParams, **kw):  # noqa: ANN001, ANN202
    llm = LLM(EngineConfig(model=str(path), num_pages=256, speculative=spec, **kw), loaded=loaded)
    outs = llm.generate(prompts, sp)
    llm.core.check_integrity()
    return [o.token_ids for o in outs], [o.finish_reason for o in outs], llm.core.counters


def test_longest_match_is_the_latest_longest() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        hay = rng.integers(0, 4, size=int(rng.integers(2, 60))).astype(np.int32)
        pat = rng.integers(0, 4, size=int(rng.integers(1, 8))).astype(np.int32)
        limit = int(rng.integers(1, hay.size + 1))
        best = (-1, 0)
        for end in range(limit):
            n = 0
            while n < pat.size and end - n >= 0 and hay[end - n] == pat[-1 - n]:
                n += 1
            if n and n >= best[1]:
                best = (end, n)
        assert longest_match(hay, limit, pat) == best


@pytest.fixture(scope="module")
def copy_prompts(smollm2_tokenizer) -> list[list[int]]:  # noqa: ANN001
    # The file twice, then its first line again: the model goes on copying (mostly), drafts follow the copies.
    ask = "# math.py\n" + TEXT + "\n\n# math_copy.py\n" + TEXT + "\n\n# math_copy2.py\ndef add(a, b):\n"
    return [smollm2_tokenizer.encode(ask), smollm2_tokenizer.encode("The three primary colors are")]


def test_the_cpu_drafting_policy_follows_the_kernel_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU's row cost and match factor are its kernel variant's measured ones (AVX-512 VNNI: cheaper rows, drafts
    as long as the match), else the EPYC's; the config's own numbers win; a GPU keeps its own."""
    cfg = EngineConfig(model="unused", device="cpu")

    def drafter(isa: cpu_gemv.Isa | None, **kw: float) -> Drafter:
        monkeypatch.setattr(cpu_gemv, "available", lambda: isa is not None)
        monkeypatch.setattr(cpu_gemv, "isa", lambda: isa)
        return Drafter(EngineConfig(model="unused", device=kw.pop("device", "cpu"), **kw))  # type: ignore[arg-type]

    assert cfg.spec_row_cost is None and cfg.spec_match_factor is None
    for isa, want in ((cpu_gemv.Isa.AVX512_VNNI, (0.2, 1.0)), (cpu_gemv.Isa.AVX_VNNI, (0.3, 0.5)),
                      (cpu_gemv.Isa.AVX2, (0.3, 0.5)), (None, (0.3, 0.5))):
        d = drafter(isa)
        assert (d.row_cost, d.match_factor) == want, isa
    d = drafter(cpu_gemv.Isa.AVX512_VNNI, spec_row_cost=0.25, spec_match_factor=0.5)
    assert (d.row_cost, d.match_factor) == (0.25, 0.5)
    d = drafter(cpu_gemv.Isa.AVX512_VNNI, device="cuda")
    assert (d.row_cost, d.match_factor) == (0.02, 0.5)


def test_smollm2_exact_greedy_equals_plain(smollm2_loaded, smollm2_path, copy_prompts) -> None:  # noqa: ANN001
    # spec_row_cost 0: every draft as long as the match allows, so long verifies and rejected tails run.
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain, _, c0 = _run(smollm2_loaded, smollm2_path, Speculative.OFF, copy_prompts[:1], sp)
    spec, _, c1 = _run(smollm2_loaded, smollm2_path, Speculative.SUFFIX, copy_prompts[:1], sp, spec_row_cost=0.0)
    assert spec == plain
    assert c0.drafted_tokens == 0 and c1.accepted_tokens > 0 and c1.drafted_tokens > c1.accepted_tokens
    assert c1.steps < c0.steps  # accepted drafts saved steps


def test_smollm2_default_cpu_path_verify_is_bit_exact(smollm2_fast, smollm2_path, copy_prompts) -> None:  # noqa: ANN001
    # The fused CPU layer runs a verify's rows as one-token decodes at their positions: the same numbers, so
    # the default path's output is plain decoding's too; a stop token and max_tokens inside an accepted run
    # end the output exactly where plain decoding does.
    sp = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    plain, _, _ = _run(smollm2_fast, smollm2_path, Speculative.OFF, copy_prompts[:1], sp)
    spec, _, c = _run(smollm2_fast, smollm2_path, Speculative.AUTO, copy_prompts, sp)
    assert spec[0] == plain[0] and c.accepted_tokens > 0
    ref = plain[0]
    stop = next(t for i, t in enumerate(ref) if i >= 16 and t not in ref[:i])  # first seen mid-run
    for mode, s, want in (
        (Speculative.NGRAM, SamplingParams(max_tokens=36, temperature=0.0, stop_token_ids=[stop]), ref[: ref.index(stop) + 1]),
        (Speculative.SUFFIX, SamplingParams(max_tokens=27, temperature=0.0, ignore_eos=True), ref[:27]),
    ):
        out, why, c = _run(smollm2_fast, smollm2_path, mode, copy_prompts[:1], s, spec_row_cost=0.0)
        assert out[0] == want and why[0] == ("stop" if s.stop_token_ids else "length"), mode
        assert c.accepted_tokens > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tiny_random_models_greedy_equals_plain(arch: str, tmp_path) -> None:  # noqa: ANN001
    cfg = (LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]) if arch == "llama" else Qwen3MoeConfig(
        **TINY, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        architectures=["Qwen3MoeForCausalLM"]))
    save_random(cfg, tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    base = [(7 * i + 3) % 250 + 1 for i in range(12)]
    prompts = [base * 3, base[:5] * 4 + [9, 8, 7]]  # repeats: the drafter proposes their continuations
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _, _ = _run(loaded, tmp_path, Speculative.OFF, prompts, sp, page_size=4, attention="torch")
    spec, _, c = _run(loaded, tmp_path, Speculative.SUFFIX, prompts, sp, page_size=4, attention="torch",
                      spec_row_cost=0.0)
    assert spec == plain and c.drafted_tokens > 0


def test_sampled_verify_keeps_the_distribution() -> None:
    # Chi-square over many draws: the first output token is distributed as p at row 0, and after an accepted
    # first draft token the second as p at row 1, whatever the draft says.
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    req = Request("r", [1], SamplingParams(temperature=0.8, top_k=5, seed=1234))
    draft = [int(logits[0].argsort()[-2]), 2]  # the second likeliest first (often rejected), then any
    p = torch.softmax(logits / 0.8, dim=-1)
    p[torch.arange(3), logits.argmin(dim=-1)] = 0.0  # top_k=5 of 6 drops each row's least likely token
    p /= p.sum(dim=-1, keepdim=True)
    p1 = p[1]
    n = 1500
    first = np.zeros(6)
    second = np.zeros(6)
    for _ in range(n):
        out = sampled_prefix(logits, req, draft)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p1)):
        expected = probs.numpy() * counts.sum()
        keep = expected > 0
        assert counts[~keep].sum() == 0
        chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
        assert chi2 < 20.5  # p = 0.001 at 5 degrees of freedom


def test_grammar_bound_tool_call_greedy_equals_plain(smollm2_fast, smollm2_path, smollm2_tokenizer) -> None:  # noqa: ANN001
    # A required tool call whose arguments repeat the conversation's: each draft row is masked by the grammar
    # after the draft tokens before it, and the output is plain constrained decoding's.
    from agentbox.chat.grammar import grammar_spec

    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"}},
        "required": ["path", "start"]}}}]
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/agentbox/engine/scheduler.py", "start": 40}}\n</tool_call>'
    text = f"Earlier calls:\n{call}\n{call}\nCall read_file again on the same path, start 40.\n"
    prompt = smollm2_tokenizer.encode(text)
    sp = SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar_spec(tools, "required", None, "hermes",
                                                                              parallel_tool_calls=False))
    plain, why0, _ = _run(smollm2_fast, smollm2_path, Speculative.OFF, [prompt], sp)
    spec, why1, c = _run(smollm2_fast, smollm2_path, Speculative.SUFFIX, [prompt], sp)
    assert spec == plain and why1 == why0 == ["stop"]
    assert c.accepted_tokens > 0


def test_usage_stats_and_sessions_report_drafts(live_server: str) -> None:
    # The shared server (default --speculative auto): usage carries the accepted / rejected draft tokens,
    # /v1/stats the totals and acceptance rate, /v1/sessions the session's counts (agentbox top's column).
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=f"{live_server}/v1", api_key="none")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=24, extra_headers={"X-Session-Id": "spec-usage"},
        messages=[{"role": "user", "content": "Repeat this code exactly.\n\n" + TEXT + "\n" + TEXT}])
    details = r.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens is not None
    assert details.rejected_prediction_tokens is not None and details.rejected_prediction_tokens >= 0
    stats = httpx.get(f"{live_server}/v1/stats").json()
    spec = stats["speculative"]
    assert spec["mode"] == "suffix" and spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0
    assert spec["accepted_tokens"] >= details.accepted_prediction_tokens
    session = httpx.get(f"{live_server}/v1/sessions/spec-usage").json()
    assert session["spec_accepted_tokens"] == details.accepted_prediction_tokens


@pytest.mark.slow
def test_tp2_verify_equals_tp1_plain(tmp_path) -> None:  # noqa: ANN001
    # Draft ids travel in StepInputs.input_ids: rank 1 scores the same extend as rank 0.
    from tests.test_tp import CONFIGS, GREEDY, _config

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(CONFIGS["llama"]).save_pretrained(tmp_path)
    base = [(7 * i + 3) % 250 + 1 for i in range(12)]
    prompts = [base * 3, base[:5] * 4]
    with LLM(_config(str(tmp_path), 1, speculative=Speculative.OFF)) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(_config(str(tmp_path), 2, speculative=Speculative.SUFFIX, spec_row_cost=0.0)) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        drafted = llm.core.counters.drafted_tokens
    assert got == ref and drafted > 0
