"""Top-1 agreement of the default CPU path with the exact one, per architecture (`agentbox bench agreement`).

The default path (`--exact-cpu` off) may round as llama.cpp does: int8-rounded activations in the quantised
kernels, fp16 weights read as fp16, the fused CPU decode where the model has one. The exact path dequantises
and widens to fp32 (transformers' numbers: the parity tests hold it there). This loads each model twice, once
per path, runs the same tokens through both teacher-forced one decode step a token (`LLM.forced_logits`: the
path a served decode takes) and reports, per architecture, the share of positions whose argmax agrees and the
max |logit difference|.

The models: SmolLM2's Q4_1 GGUF (the embedded model: Llama, 4-bit weights, int8 activations on the default
path), over this module's own source as text; and a tiny random checkpoint of every other served architecture,
built with transformers' config classes in the tests' shapes and saved in fp16 (the form whose default path
differs: fp16 weights read as fp16, the exact path widens them), over random token ids. A random model's top
two logits are often nearly tied, so its flips say less than a real model's: `decided` counts the positions
whose exact top-2 margin exceeds that position's max |difference| (tests/top_tokens.py), where a flip would
mean a wrong kernel rather than rounding.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentbox.bench.cpu_rows import cpu_info

SMOLLM2 = "smollm2"

# The tests' tiny shapes (tests/*_models.py), with room for 256 positions and a page of slack.
_QWEN3_5_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=1024,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                     linear_conv_kernel_dim=4)
_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
                    temporal_patch_size=2, spatial_merge_size=1)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                          max_position_embeddings=1024, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                          architectures=["Qwen3MoeForCausalLM"])  # every layer MoE: llama.cpp maps no dense one


def _qwen3_5() -> Any:
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=_QWEN3_5_TEXT, vision_config=_QWEN_VISION,
                         architectures=["Qwen3_5ForConditionalGeneration"])


def _glm4_7_flash() -> Any:
    from transformers import Glm4MoeLiteConfig

    return Glm4MoeLiteConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
        v_head_dim=16, max_position_embeddings=1024, routed_scaling_factor=1.8, architectures=["Glm4MoeLiteForCausalLM"],
        # transformers says it as mlp_layer_types; the converter reads only this key (as the release's config has it)
        first_k_dense_replace=1)


def _gemma4() -> Any:
    from transformers import Gemma4Config, Gemma4VisionConfig

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                vocab_size=256, max_position_embeddings=1024, attention_k_eq_v=True, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=256, final_logit_softcapping=30.0)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                        architectures=["Gemma4ForConditionalGeneration"])


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=256, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=1024, sliding_window=4,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 256,
                                         "rope_theta": 150000.0},
                        architectures=["GptOssForCausalLM"])


def _deepseek_v4() -> Any:
    from transformers import DeepseekV4Config

    csa, hca, sliding = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
    return DeepseekV4Config(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=[csa, hca, csa, sliding], compress_rates={csa: 4, hca: 32}, sliding_window=6, o_groups=2,
        o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3, hc_mult=2, hc_sinkhorn_iters=5,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], swiglu_limit=0.5, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=8192, architectures=["DeepseekV4ForCausalLM"])


def _qwen4_exp() -> Any:
    from transformers import Qwen4ExpConfig

    linear, indexed = "linear_attention", "indexed_attention"
    text = dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, hc_count=4, hc_lowrank=16, ple_layer_ids=[1, 4], ple_embed_dim=16, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=3,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        output_gate_type="sigmoid", max_position_embeddings=4096, eos_token_id=2, pad_token_id=0,
        layer_types=[linear, indexed, linear, linear, indexed],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True))
    return Qwen4ExpConfig(text_config=text, vision_config=dict(_QWEN_VISION, out_hidden_size=32),
                          architectures=["Qwen4ExpForConditionalGeneration"])


def _nemotron_h() -> Any:
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=256, hidden_size=64, layers_block_type=["linear_attention", "moe", "full_attention",
                                                           "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=1.5, max_position_embeddings=4096,
        architectures=["NemotronHForCausalLM"])


@dataclass(frozen=True)
class TinyArch:
    config: Callable[[], Any]
    zero_centred_norms: bool = False  # the checkpoint stores w - 1 (Qwen3.5's RMSNorm): random values near zero
    no_mtp: bool = False  # the converter asks for --no-mtp (the release has MTP layers these checkpoints lack)
    bpe_vocab: bool = False  # the converter writes the BPE vocabulary (llama_server.convert_hf says why)
    gguf: str | None = "q8_0"  # the converter's outtype; None: the fp16 checkpoint is the default path's form
    why_not_gguf: str = ""


TINY_ARCHS: dict[str, TinyArch] = {
    "qwen3_moe": TinyArch(_qwen3_moe),
    "qwen3_5_hybrid": TinyArch(_qwen3_5, zero_centred_norms=True, no_mtp=True),
    "glm4_7_flash_mla": TinyArch(_glm4_7_flash),
    "gemma4": TinyArch(_gemma4, bpe_vocab=True),
    "gpt_oss": TinyArch(_gpt_oss, gguf=None, why_not_gguf="agentbox's GGUF reader has no gpt-oss architecture"),
    "deepseek_v4": TinyArch(_deepseek_v4),
    "qwen3_8_flash_next": TinyArch(_qwen4_exp, zero_centred_norms=True),
    "nemotron_h": TinyArch(_nemotron_h),
}
ARCHS = (SMOLLM2, *TINY_ARCHS)


def _randomize(hf: torch.nn.Module, arch: TinyArch, g: torch.Generator) -> None:
    """Every weight random as the tests make them: norms near their identity, slow decays (a state carried wrong
    shows for many tokens), correction biases large enough to change the experts chosen, the rest small."""
    cfg = hf.config
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: distinct experts per token
                n, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                p.copy_(torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(p.shape[0])]))
                continue
            if not p.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue  # derived from the config, not saved
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-4.0, -2.0, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 0.5, generator=g))
            elif name.endswith(".D"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name or "layer_scalar" in name or name.endswith("scale"):
                centre = 0.0 if arch.zero_centred_norms and "linear_attn.norm" not in name else 1.0
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def save_tiny_arch(name: str, d: Path, tokenizer: Any, seed: int = 0) -> Path:
    """The tiny random `name` checkpoint with `tokenizer` (its vocabulary), saved in fp16 into `d`; returns `d`."""
    import transformers

    from agentbox.bench.llama_server import converter_tokenizer

    arch = TINY_ARCHS[name]
    cfg = arch.config()
    tokenizer = converter_tokenizer(tokenizer, cfg.architectures[0])
    text = cfg.get_text_config()
    text.vocab_size = len(tokenizer)
    if hasattr(text, "vocab_size_per_layer_input"):  # Gemma 4's per-layer input table is indexed by token id
        text.vocab_size_per_layer_input = len(tokenizer)
    torch.manual_seed(seed)
    hf = getattr(transformers, cfg.architectures[0])(cfg).float().eval()
    _randomize(hf, arch, torch.Generator().manual_seed(seed))
    hf.half().save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def tiny_model(name: str, root: Path, tokenizer: Any) -> tuple[str, str]:
    """(model path, form): the tiny `name` as llama.cpp's converter writes it in Q8_0 (its quantised linears take
    the int8 kernels on the default path), else the fp16 checkpoint, the form saying why."""
    from agentbox.bench.llama_server import convert_hf

    arch = TINY_ARCHS[name]
    hf_dir = save_tiny_arch(name, root / name, tokenizer)
    if arch.gguf is None:
        return str(hf_dir), f"fp16 safetensors ({arch.why_not_gguf})"
    try:
        gguf = convert_hf(hf_dir, root / f"{name}-{arch.gguf}.gguf", arch.gguf, no_mtp=arch.no_mtp,
                          bpe_vocab=arch.bpe_vocab)
        return str(gguf), f"GGUF {arch.gguf} from llama.cpp's converter"
    except (RuntimeError, FileNotFoundError) as e:
        return str(hf_dir), f"fp16 safetensors (no converter GGUF: {e})"


def compare(default: torch.Tensor, exact: torch.Tensor) -> dict[str, Any]:
    """Agreement of `default` with `exact` ([positions, vocab] logits)."""
    diff = (default.float() - exact.float()).abs().amax(-1)
    agree = default.argmax(-1) == exact.argmax(-1)
    top2 = exact.float().topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > diff
    return {
        "positions": len(agree),
        "top1_agreement": round(agree.float().mean().item(), 4),
        "max_abs_logit_diff": float(diff.max().item()),
        "exact_logit_std": round(exact.float().std().item(), 4),  # the scale the difference compares with
        "decided_positions": int(decided.sum()),
        "flips_at_decided": int((decided & ~agree).sum()),
    }


def forced_run(model: str, tokens: list[int], exact: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """`model` loaded on the CPU for one path, `tokens` teacher-forced: (logits, what ran and how fast)."""
    from agentbox.config import CPU_PAGE_SIZE, EngineConfig
    from agentbox.engine.llm import LLM

    pages = -(-len(tokens) // CPU_PAGE_SIZE) + 4
    with LLM(EngineConfig(model=model, device="cpu", exact_cpu=exact, num_pages=pages, max_num_seqs=1,
                          state_snapshots=0)) as llm:
        llm.forced_logits(tokens[:8])  # warm-up: first-call allocations and kernel builds are not timed
        t0 = time.perf_counter()
        logits = llm.forced_logits(tokens)
        seconds = time.perf_counter() - t0
        fused = llm.core.runner.cpu_decode
    return logits, {"fused_decode": type(fused).__name__ if fused is not None else None,
                    "decode_tok_s": round(len(tokens) / seconds, 1)}


def arch_row(name: str, model: str, tokens: list[int], sides: tuple[bool, bool] = (False, True)) -> dict[str, Any]:
    """One architecture's row: `sides` are the exact_cpu settings of the two runs (the default path, the exact
    one); (True, True) compares the exact path with itself."""
    a, run_a = forced_run(model, tokens, sides[0])
    b, run_b = forced_run(model, tokens, sides[1])
    row = {"arch": name, "model": model, "exact_cpu": list(sides), **compare(a, b)}
    row["identical"] = row["max_abs_logit_diff"] == 0.0
    return {**row, "default": run_a, "exact": run_b}


def _smollm2_tokens(tokenizer: Any, positions: int) -> tuple[str, list[int]]:
    from agentbox.hub.embedded import embedded_model_path

    path = embedded_model_path()
    assert path is not None  # smollm2_tokenizer has said how to install it otherwise
    return str(path), tokenizer.encode(Path(__file__).read_text())[:positions]


def agreement_report(archs: list[str], positions: int = 256, models_dir: Path | None = None,
                     forms: dict[str, Callable[[str, Path, Any], tuple[str, str]]] | None = None,
                     sides: tuple[bool, bool] = (False, True)) -> dict[str, Any]:
    """Every named architecture's row (`ARCHS`), the tiny models written under `models_dir` (a temporary
    directory if None) by `forms` (name -> its writer; `tiny_model` for any not named), with the CPU named;
    `sides` as `arch_row`'s."""
    from agentbox.bench.tiny_models import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = models_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in archs:
            if name == SMOLLM2:
                model, tokens = _smollm2_tokens(tokenizer, positions)
                form = "GGUF Q4_1 (the embedded SmolLM2-135M-Instruct), its tokenizer over this module's source"
            else:
                model, form = (forms or {}).get(name, tiny_model)(name, root, tokenizer)
                gen = torch.Generator().manual_seed(0)
                tokens = torch.randint(3, len(tokenizer), (positions,), generator=gen).tolist()
                form += ", random token ids"
            try:
                rows.append({**arch_row(name, model, tokens, sides), "form": form})
            except Exception as e:  # noqa: BLE001 - one architecture that does not load is a row, not the end
                rows.append({"arch": name, "model": model, "form": form, "error": f"{type(e).__name__}: {e}"})
    return {"bench": "agreement", "cpu": cpu_info(), "torch_threads": torch.get_num_threads(),
            "method": "teacher-forced, one decode step a token; default path (exact_cpu off) vs --exact-cpu",
            "archs": rows}
