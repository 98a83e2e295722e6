"""The throughput, cache and idle benchmarks on a tiny random Llama: the JSON they print, the ratio
arithmetic, the random-weight model builder, and one short idle measurement of a real server. No timing
assertions: speed is what the benchmarks report, not what tests check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from agentbox.bench.throughput import Rates, compare_throughput, random_model, ratios, transformers_rates

TINY = LlamaConfig(
    architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a word-level tokenizer (the server needs one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, TINY.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TINY).save_pretrained(path)
    return path


def test_rates_arithmetic() -> None:
    r = Rates(batch=8, prompt_len=100, new_tokens=11, ttft_s=2.0, decode_s=4.0)
    assert r.prefill_tok_s == 400.0  # 8 * 100 prompt tokens in 2 s
    assert r.decode_tok_s == 20.0  # 8 * 10 tokens after the first, in 4 s
    assert r.as_dict()["decode_tok_s"] == 20.0 and r.as_dict()["batch"] == 8


def test_ratios_divide_ours_by_theirs() -> None:
    ours = {"batch_1": {"prefill_tok_s": 100.0, "decode_tok_s": 10.0},
            "batch_8": {"prefill_tok_s": 800.0, "decode_tok_s": 60.0}}
    theirs = {"batch_1": {"prefill_tok_s": 50.0, "decode_tok_s": 20.0},
              "batch_8": {"prefill_tok_s": 400.0, "decode_tok_s": 30.0}}
    assert ratios(ours, theirs) == {
        "prefill_batch_1": 2.0,
        "decode_batch_1": 0.5,
        "prefill_batch_8": 2.0,
        "decode_batch_8": 2.0,
        "decode_ours_batch_8_over_transformers_batch_1": 3.0,
    }


def test_compare_throughput_report_shape(tiny_llama: Path) -> None:
    report = compare_throughput(str(tiny_llama), new_tokens=4, prompt_len=6, batches=(1, 3), device="cpu", repeats=2)
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["torch_threads"] >= 1 and report["repeats"] == 2
    for side in ("ours", "transformers"):
        assert set(report[side]) == {"batch_1", "batch_3"}
        for key, batch in (("batch_1", 1), ("batch_3", 3)):
            entry = report[side][key]
            assert entry["batch"] == batch and entry["prompt_len"] == 6 and entry["new_tokens"] == 4
            assert entry["ttft_s"] > 0 and entry["decode_s"] > 0
            assert math.isclose(entry["decode_tok_s"], batch * 3 / entry["decode_s"])
    assert set(report["ratios"]) == {
        "prefill_batch_1", "decode_batch_1", "prefill_batch_3", "decode_batch_3",
        "decode_ours_batch_3_over_transformers_batch_1",
    }
    assert all(v > 0 for v in report["ratios"].values())


def test_transformers_rates_generates_exactly_the_asked_tokens(tiny_llama: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    r = transformers_rates(hf, [[5, 6, 7, 8], [9, 10, 11, 12]], new_tokens=5)
    assert (r.batch, r.prompt_len, r.new_tokens) == (2, 4, 5)


def test_random_model_runs_in_the_engine() -> None:
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    loaded = random_model(TINY, torch.float32, "cpu")
    params = dict(loaded.model.named_parameters())
    assert all(torch.all(p == 1) for n, p in params.items() if "norm" in n)
    weights = [p for n, p in params.items() if p.ndim == 2]
    assert all(torch.isfinite(p).all() and 0.01 < p.std() < 0.03 for p in weights)
    llm = LLM(EngineConfig(device="cpu", num_pages=16, cache_policy="none"), loaded=loaded)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_cache_report_shape(tiny_llama: Path) -> None:
    from agentbox.bench.cache_bench import cache_report

    report = cache_report(str(tiny_llama), prefix_tokens=100, question_tokens=8, answer_tokens=4)
    assert report["cold"]["prompt_tokens"] == 108 and report["cold"]["cached_tokens"] == 0
    assert report["warm"]["prompt_tokens"] == 108 + 4 + 8
    assert 0.0 <= report["identical_prefix"]["hit_rate"] <= 1.0
    assert report["speedup"] > 0


@pytest.mark.slow
def test_idle_cpu_of_a_real_server(tiny_llama: Path) -> None:
    from agentbox.bench.idle import measure_idle_cpu

    report = measure_idle_cpu(str(tiny_llama), 2.0, ["--device", "cpu", "--num-pages", "64"], warmup_requests=2)
    assert 1.9 < report["seconds"] < 4.0
    assert len(report["processes"]) >= 2  # the API process and the engine core process
    assert report["percent_of_one_core"] >= 0.0
    assert math.isclose(report["cpu_s"], sum(p["cpu_s"] for p in report["processes"]))
