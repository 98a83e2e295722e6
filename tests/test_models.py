"""Our model code against transformers with the same weights: tiny random checkpoints and SmolLM2 GGUF."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch
from model_harness import PagedRunner, assert_mixed_batch_equals_alone
from top_tokens import assert_top_tokens_agree
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from agentbox.layers.quant import int4
from agentbox.models.base import head_dim_of
from agentbox.models.loader import (
    LoadedModel,
    ModelSource,
    iter_weights,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model,
)
from agentbox.models.registry import model_class

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

TINY_CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], rope_theta=10000.0),
    "llama3-rope-tied": LlamaConfig(
        **TINY,
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "qwen2-bias": Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3-qknorm": Qwen3Config(**TINY, architectures=["Qwen3ForCausalLM"], head_dim=32),
}


def save_tiny(kind: str, path: Path, max_shard_size: str | None = None) -> torch.nn.Module:
    """A transformers model with every parameter random (norm weights too), saved as safetensors."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(TINY_CONFIGS[kind], attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(path, **kwargs)
    return hf


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return hf, load_model(str(path), torch.float32, "cpu")


PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8]


def test_prefill_matches_transformers(tiny: tuple[torch.nn.Module, LoadedModel]) -> None:
    hf, ours = tiny
    expected = hf(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours).step({0: PROMPT})[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_match_transformers(tiny: tuple[torch.nn.Module, LoadedModel]) -> None:
    hf, ours = tiny
    expected = hf(torch.tensor([PROMPT])).logits[0]
    runner = PagedRunner(ours, page_size=4)
    got = [runner.step({0: PROMPT[:6]})[0], runner.step({0: PROMPT[6:9]})[0]]  # prefix cached, chunk of 3
    got += [runner.step({0: [t]})[0] for t in PROMPT[9:]]  # one token at a time
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_each_sequence_alone(tiny: tuple[torch.nn.Module, LoadedModel]) -> None:
    _, ours = tiny
    assert_mixed_batch_equals_alone(ours, PROMPT)


def test_sharded_checkpoint_loads_the_same(tmp_path: Path) -> None:
    save_tiny("qwen3-qknorm", tmp_path / "single")
    hf = save_tiny("qwen3-qknorm", tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours = load_model(str(tmp_path / "sharded"), torch.float32, "cpu")
    expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(ours).step({0: PROMPT})[0], expected, atol=1e-4, rtol=1e-4)
    names = {n for n, _ in iter_weights(resolve_model(str(tmp_path / "sharded")))}
    assert names == {n for n, _ in iter_weights(resolve_model(str(tmp_path / "single")))}


def test_bfloat16_model_tracks_fp32(tiny: tuple[torch.nn.Module, LoadedModel], tmp_path: Path) -> None:
    hf, ours = tiny
    hf.save_pretrained(tmp_path)
    bf16 = load_model(str(tmp_path), torch.bfloat16, "cpu")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    ref = PagedRunner(ours).step({0: PROMPT})[0]
    got = PagedRunner(bf16).step({0: PROMPT})[0]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == ModelSource("gguf", (tmp_path / "a.gguf").resolve(), "a")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_is_named() -> None:
    config = LlamaConfig(**TINY, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: .*GptOssForCausalLM, .*LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        model_class(config)


def test_eos_ids_from_generation_config_and_template(tmp_path: Path) -> None:
    save_tiny("qwen2-bias", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "{{ '<|im_start|>' + m + '<|im_end|>' }}",
                "added_tokens_decoder": {"250": {"content": "<|im_end|>"}, "251": {"content": "<|eot_id|>"}},
            }
        )
    )
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    assert loaded.eos_token_ids == [7, 9, 250]  # <|eot_id|> is in the vocab but not in the template
    assert loaded.vocab_size == 256 and loaded.num_kv_heads == 2 and loaded.head_dim == 16


# --- GGUF files written from the tiny models, the way llama.cpp's converter writes them ------------------

LLAMA_CPP_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What convert_hf_to_gguf.py does to llama-arch q/k rows (interleaved rope pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf: torch.nn.Module, arch: str, path: Path) -> Path:
    config = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim_of(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(3)
    tied = config.tie_word_embeddings
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{LLAMA_CPP_NAMES[module]}.{kind}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if arch == "llama" and ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_key_value_heads)
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("kind", "arch"), [("llama", "llama"), ("qwen2-bias", "qwen2"), ("qwen3-qknorm", "qwen3")]
)
def test_gguf_checkpoint_matches_transformers(kind: str, arch: str, tmp_path: Path) -> None:
    hf = save_tiny(kind, tmp_path / "hf")
    path = write_gguf(hf, arch, tmp_path / f"tiny-{arch}.gguf")
    ours = load_model(str(tmp_path), torch.float32, "cpu")  # the directory holds exactly one .gguf
    assert ours.source.kind == "gguf" and ours.source.path == path.resolve()
    assert ours.hf_config.architectures == TINY_CONFIGS[kind].architectures
    assert ours.eos_token_ids == [3]
    expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(ours).step({0: PROMPT})[0], expected, atol=1e-4, rtol=1e-4)


# --- SmolLM2-135M-Instruct, Q4_1 GGUF: ours against transformers loading the same file ---------------


@dataclass
class SmolLM2:
    ours: LoadedModel
    hf: torch.nn.Module
    prompt: list[int]
    home: Path  # AGENTBOX_HOME while the module runs: where the converted tokenizer is cached


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolLM2]:
    # One thread: with the CPU shared, OpenMP workers spin-waiting on each other cost 5-10x on small ops.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    home = tmp_path_factory.mktemp("agentbox-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTBOX_HOME", str(home))
        with int4.cpu_kernel(int4.Int4Kernel.DENSE):  # exact against transformers (see exact_cpu_kernels)
            ours = load_model(str(smollm2_path), torch.float32, "cpu")
        hf = AutoModelForCausalLM.from_pretrained(
            smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
        ).eval()
        tokenizer = load_tokenizer(ours.source)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
            add_generation_prompt=True,
            tokenize=True,
        )
        if not isinstance(prompt, list):
            prompt = prompt["input_ids"]
        yield SmolLM2(ours, hf, list(prompt), home)
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_smollm2_config_and_eos(smollm2: SmolLM2) -> None:
    ours = smollm2.ours
    config = load_config(ours.source)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (30, 9, 3, 64)
    assert ours.max_model_len == 8192 and ours.vocab_size == 49152
    assert 2 in ours.eos_token_ids  # <|im_end|>


@pytest.mark.slow
def test_smollm2_tokenizer_is_cached(smollm2: SmolLM2) -> None:
    cached = list((smollm2.home / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("SmolLM2-135M-Instruct")
    again = load_tokenizer(smollm2.ours.source)  # from the cache now: no GGUF conversion
    text = "def f(x):\n    return x + 1  # héllo"
    assert again.encode(text) == AutoTokenizer.from_pretrained(cached[0]).encode(text)
    assert again.decode(again.encode(text)) == text


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2: SmolLM2) -> None:
    with torch.no_grad():
        expected = smollm2.hf(torch.tensor([smollm2.prompt])).logits[0]
    got = PagedRunner(smollm2.ours, num_pages=32, page_size=16).step({0: smollm2.prompt})[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2: SmolLM2) -> None:
    n, prompt = 40, smollm2.prompt
    with torch.no_grad():
        ref = smollm2.hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    ref_ids = ref[0, len(prompt) :].tolist()
    assert len(ref_ids) == n  # a story: no end of turn this early
    got = PagedRunner(smollm2.ours, num_pages=32, page_size=16).greedy(0, prompt, n)
    assert got == ref_ids


@pytest.mark.slow
def test_smollm2_on_the_default_cpu_kernels_agrees_with_transformers(smollm2: SmolLM2, smollm2_fast: LoadedModel) -> None:
    """The engine's default CPU path (4-bit layers and the Q8_0 head through kernels/cpu_gemv, activations
    rounded to int8 per 32 as llama.cpp does) picks transformers' top token wherever it is decided."""
    from agentbox.kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_gemv.unavailable_reason()}")
    model = smollm2_fast.model
    assert model.model.layers[0].mlp.down_proj.int4_kernel is int4.Int4Kernel.CPU_SIMD
    assert model.model.embed_tokens.quant is not None and model.model.embed_tokens.quant.is_q8
    tokenizer = load_tokenizer(smollm2.ours.source)
    text = " Once upon a time, in a small town, there lived a robot named Max who loved to paint the sunset."
    ids = smollm2.prompt + tokenizer.encode(text)
    with torch.no_grad():
        expected = smollm2.hf(torch.tensor([ids])).logits[0]
    for rows in (ids, ids[:24]):  # the many-row path (dequantise + sgemm) and the kernel itself
        got = PagedRunner(smollm2_fast, num_pages=32, page_size=16).step({0: rows})[0]
        # measured: 4.8 % / 8.4 % of the logit range at most; 42 of 65 / 12 of 24 positions decided
        assert_top_tokens_agree(got, expected[: len(rows)], max_err=0.15 * expected.abs().max().item(),
                                min_decided=0.3)
