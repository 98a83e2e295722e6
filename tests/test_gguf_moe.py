"""GGUF MoE (qwen3moe): a tiny random Qwen3-MoE written with gguf's writer the way llama.cpp's converter lays it
out (all experts of a layer in one 3-D `ffn_*_exps` tensor, `ffn_gate_inp` router, q/k norms, unpermuted
q/k), one expert type per layer, loaded by our loader and compared with transformers on the dequantised
twin (fp32). Q4_0 / Q4_1 / Q4_K experts end in the canonical int4 form; a Q4_K_M-like layer (Q6_K down) and
a Q8_0 one in the k-bit form (every k-bit type: tests/test_gguf_moe_bits.py). tp 2 over two processes:
tests/test_models_moe_tp.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from model_harness import PagedRunner
from moe_harness import DECODE, PROMPT, engine_greedy_matches, hf_logits, paged_logits
from test_quant_gguf import quantise
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from agentbox.layers.experts import ExpertShard, FusedMoE
from agentbox.layers.experts.bits import BitsExperts
from agentbox.layers.experts.gguf import GGUFExperts, pack_k
from agentbox.layers.experts.int4 import Int4Experts
from agentbox.layers.quant import resident_weight_bytes
from agentbox.layers.quant.gguf import GGUFBlocks
from agentbox.layers.quant.int4 import pack_rows_int32
from agentbox.layers.rotary import rope_parameters
from agentbox.layers.weight_loading import load_weight
from agentbox.models.gguf_file import gguf_config, gguf_weights
from agentbox.models.gguf_llama import llama_tensor_name
from agentbox.models.loader import load_model

# The exact CPU path: experts stay in the canonical form (the default repacks them: tests/test_moe_cpu.py).
pytestmark = pytest.mark.usefixtures("exact_cpu_kernels")
Q = GGMLQuantizationType
H, FFN, E = 256, 256, 4  # K-quant blocks are 256 columns: H and FFN hold one each
# (gate, up, down) per layer: what a llama.cpp quantiser writes; Q4_K_M puts some ffn_down_exps in Q6_K
LAYER_TYPES = [(Q.Q4_0,) * 3, (Q.Q4_1,) * 3, (Q.Q4_K,) * 3, (Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0,) * 3]


def qwen3moe_config(layers: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=H, intermediate_size=FFN, moe_intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=256,
        num_experts=E, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )


CONFIG = qwen3moe_config(len(LAYER_TYPES))
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def _blocks(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks shaped like w with bytes last, fp32 dequantised twin) of an [..., in] weight."""
    flat = w.reshape(-1, w.shape[-1]).astype(np.float32)
    raw = quantise(flat, qtype, rng)
    deq = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    return raw.reshape(*w.shape[:-1], -1), deq.astype(np.float32)


def write_qwen3moe(
    path: Path, seed: int = 0, layer_types: list[tuple[Q, Q, Q]] = LAYER_TYPES
) -> dict[str, torch.Tensor]:
    """The GGUF file, one (gate, up, down) expert type per layer; returns the transformers state dict it
    dequantises to."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in (
        ("block_count", len(layer_types)), ("context_length", 256), ("embedding_length", H), ("head_count", 4),
        ("head_count_kv", 2), ("key_length", 64), ("value_length", 64), ("vocab_size", 256), ("expert_count", E),
        ("expert_used_count", 2), ("expert_feed_forward_length", FFN),
    ):
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_eos_token_id(3)
    state: dict[str, torch.Tensor] = {}

    def dense(name: str, gname: str, shape: tuple[int, ...], norm: bool = False) -> None:
        w = (1 + 0.1 * rng.standard_normal(shape) if norm else 0.05 * rng.standard_normal(shape)).astype(np.float32)
        writer.add_tensor(gname, w)
        state[name] = torch.from_numpy(w)

    def quantised(name: str, gname: str, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
        raw, deq = _blocks(0.05 * rng.standard_normal(shape), qtype, rng)
        writer.add_tensor(gname, raw, raw_dtype=qtype)
        if name:
            state[name] = torch.from_numpy(deq)
        return deq

    dense("model.embed_tokens.weight", "token_embd.weight", (256, H))
    for layer, (t_gate, t_up, t_down) in enumerate(layer_types):
        hf, blk = f"model.layers.{layer}", f"blk.{layer}"
        for proj, rows in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128), ("o_proj", H)):
            quantised(f"{hf}.self_attn.{proj}.weight", f"{blk}.{_ATTN[proj]}.weight", (rows, 256), Q.Q8_0)
        for module, gname in _NORMS.items():
            shape = (64,) if "q_norm" in module or "k_norm" in module else (E, H) if module == "mlp.gate" else (H,)
            dense(f"{hf}.{module}.weight", f"{blk}.{gname}.weight", shape, norm=module != "mlp.gate")
        gate = quantised("", f"{blk}.ffn_gate_exps.weight", (E, FFN, H), t_gate)
        up = quantised("", f"{blk}.ffn_up_exps.weight", (E, FFN, H), t_up)
        quantised(f"{hf}.mlp.experts.down_proj", f"{blk}.ffn_down_exps.weight", (E, H, FFN), t_down)
        state[f"{hf}.mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate([gate, up], axis=1))
    dense("model.norm.weight", "output_norm.weight", (H,), norm=True)
    dense("lm_head.weight", "output.weight", (256, H))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def twin(state: dict[str, torch.Tensor], config: Qwen3MoeConfig = CONFIG) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    hf.load_state_dict(state)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3moe.gguf"
    return path, twin(write_qwen3moe(path))


def _experts(loaded) -> list[FusedMoE]:  # noqa: ANN001 - LoadedModel
    return [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]


def test_config_from_qwen3moe_metadata(tiny) -> None:  # noqa: ANN001
    config = gguf_config(tiny[0])
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "head_dim", "hidden_size",
                "num_key_value_heads", "norm_topk_prob"):
        assert getattr(config, key) == getattr(CONFIG, key), key
    assert rope_parameters(config) == rope_parameters(CONFIG)
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1


def test_dense_weights_name_every_expert(tiny) -> None:  # noqa: ANN001
    """Outside the engine (keep_quantised off) experts come dequantised, one HF-named tensor per expert."""
    path, hf = tiny
    weights = dict(gguf_weights(path, gguf_config(path)))
    assert sum(".experts." in n for n in weights) == 3 * E * len(LAYER_TYPES)
    experts = hf.model.layers[3].mlp.experts
    torch.testing.assert_close(weights["model.layers.3.mlp.experts.2.up_proj.weight"], experts.gate_up_proj[2, FFN:])
    torch.testing.assert_close(weights["model.layers.3.mlp.experts.1.down_proj.weight"], experts.down_proj[1])


def test_gguf_moe_matches_the_dequantised_twin(tiny) -> None:  # noqa: ANN001
    path, hf = tiny
    ours = load_model(str(path), torch.float32, "cpu")
    methods = [type(m.method) for m in _experts(ours)]
    # 4-bit layers stay 4-bit; the Q6_K-down and the Q8_0 layers are k-bit
    assert methods == [Int4Experts, Int4Experts, Int4Experts, BitsExperts, BitsExperts]
    torch.testing.assert_close(paged_logits(ours), hf_logits(hf), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert PagedRunner(ours).greedy(0, PROMPT, 8) == ref[0, len(PROMPT) :].tolist()


def _file_expert_bytes(qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return 3 * E * FFN * H // block * size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_experts_stay_near_the_file_size(tiny, dtype: torch.dtype) -> None:  # noqa: ANN001
    """Codes at 4 bits plus a scale and an offset per 32 weights in the compute dtype: Q4_1 (20 bytes per
    32 in the file) is exact in bf16, Q4_0 / Q4_K (18 bytes) are 20/18 = 1.11x; fp32 scales add 4 bytes."""
    ours = load_model(str(tiny[0]), dtype, "cpu")
    ratios = [
        resident_weight_bytes(m) / _file_expert_bytes(types[0])
        for m, types in zip(_experts(ours), LAYER_TYPES, strict=True)
        if isinstance(m.method, Int4Experts)
    ]
    per32 = 16 + 2 * dtype.itemsize  # bytes per 32 weights resident
    expected = [per32 / 18, per32 / 20, per32 / 18]
    assert ratios == pytest.approx(expected, rel=1e-9)
    if dtype is torch.bfloat16:
        assert ratios[1] == pytest.approx(1.0) and max(ratios) < 1.12


def test_each_rank_holds_its_half_of_every_expert(tiny) -> None:  # noqa: ANN001
    """The shards without processes: rank r's experts dequantise to rows [r*I/2, (r+1)*I/2) of the twin's
    gate and up and the same columns of its down, in the int4 form where the layer's types allow it, else
    the k-bit form (a down shard, 128 of 256 columns, cuts a K-quant block: read whole, cut at a group)."""
    from agentbox.parallel.state import set_tp_state

    path, hf = tiny
    half = FFN // 2
    try:
        for rank in (0, 1):
            set_tp_state(rank, 2)
            ours = load_model(str(path), torch.float32, "cpu")
            for layer, (moe, ref) in enumerate(zip(_experts(ours), hf.model.layers, strict=True)):
                gate_up, down = ref.mlp.experts.gate_up_proj, ref.mlp.experts.down_proj
                rows = torch.cat([torch.arange(half) + rank * half, FFN + torch.arange(half) + rank * half])
                for e in range(E):
                    w13, w2 = moe.method.dequantized_expert(moe, e, torch.float32)
                    torch.testing.assert_close(w13, gate_up[e, rows], atol=1e-6, rtol=0, msg=f"layer {layer} w13")
                    torch.testing.assert_close(
                        w2, down[e, :, rank * half : (rank + 1) * half], atol=1e-6, rtol=0, msg=f"layer {layer} w2"
                    )
            assert [type(m.method) for m in _experts(ours)] == [Int4Experts] * 3 + [BitsExperts] * 2
    finally:
        set_tp_state(0, 1)


def test_packing_is_the_contract_layout() -> None:
    """pack_k (bytes, one transpose) equals int4.pack_rows_int32 of each expert's [K, N] codes, bit for bit."""
    q = torch.randint(0, 16, (3, 40, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = torch.stack([pack_rows_int32(q[e].t().contiguous()) for e in range(3)])
    assert torch.equal(pack_k(q), expected)


def test_what_is_not_mapped_is_named() -> None:
    """Shared experts (Qwen2-MoE's ffn_*_shexp) are not a qwen3moe tensor: refused by name, not skipped."""
    assert llama_tensor_name("blk.7.ffn_down_exps.weight") == "model.layers.7.mlp.experts.{e}.down_proj.weight"
    assert llama_tensor_name("blk.7.ffn_gate_inp.weight") == "model.layers.7.mlp.gate.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_shexp.weight"):
        llama_tensor_name("blk.0.ffn_gate_shexp.weight")


def test_an_expert_of_the_wrong_shape_is_refused() -> None:
    layer = FusedMoE(2, 1, H, FFN, renormalize=True, method=GGUFExperts())
    raw = quantise(np.zeros((FFN, H // 2), np.float32), Q.Q4_0, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"gate of expert 1 is \(256, 128\), expected \(256, 256\)"):
        load_weight(layer.w13_weight, GGUFBlocks(Q.Q4_0, (FFN, H // 2), raw), 1, ExpertShard.GATE)


def test_engine_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    """Through the engine (scheduler, paged KV, sampler): the same greedy tokens as transformers."""
    path, hf = tiny
    engine_greedy_matches(path, hf, load_model(str(path), torch.float32, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_gguf_moe_bf16_on_cuda(tiny) -> None:  # noqa: ANN001
    """On CUDA in bf16 (int4 experts through fused_moe_int4 where the kernel is built, k-bit ones through
    fused_moe_bits): prefill and decode logits near the fp32 twin's, at bf16's tolerance."""
    from test_gpu import _assert_close_bf16

    path, hf = tiny
    ours = load_model(str(path), torch.bfloat16, "cuda")
    assert [type(m.method) for m in _experts(ours)] == [Int4Experts] * 3 + [BitsExperts] * 2
    assert ours.model.model.layers[0].mlp.experts.w13_qweight.is_cuda
    assert ours.model.model.layers[3].mlp.experts.w2_qhigh.is_cuda
    runner = PagedRunner(ours, page_size=4, device="cuda")
    got = [runner.step({0: PROMPT})[0]] + [runner.step({0: [t]})[0] for t in DECODE]
    _assert_close_bf16(torch.cat(got).cpu(), hf_logits(hf))
