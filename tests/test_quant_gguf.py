"""GGUF kept quantised: tiny Llamas written with gguf's writer, every linear weight in one GGML type, loaded
by our loader and compared with transformers running the dequantised twin (gguf's dequantize is the
reference). Q4_0/Q4_1/Q4_K also run through the int4 form (codes + scale/offset per 32 columns)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from model_harness import PagedRunner
from top_tokens import assert_top_tokens_agree
from transformers import AutoModelForCausalLM, LlamaConfig

from agentbox.layers.quant import QuantMethod, resident_weight_bytes
from agentbox.layers.quant.bits import BitsKernel
from agentbox.layers.quant.gguf import GGUFBlocks, GGUFLinearMethod, int4_groups
from agentbox.layers.quant.int4 import Int4Kernel, dequantize
from agentbox.layers.weight_loading import load_weight
from agentbox.models.loader import load_model

Q = GGMLQuantizationType
CONFIG = LlamaConfig(
    architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0,
)
NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
PROMPT = [5, 17, 100, 3, 99, 42, 7, 120, 64, 1, 33, 8]


def quantise(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The raw blocks of `w` in `qtype`: gguf's quantiser where it has one; for the K-quants (gguf has no
    quantiser for them) random codes with small, valid scales in the published block layout."""
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K):
        return gguf.quants.quantize(w, qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // bs, ts), dtype=np.uint8)
    if qtype in (Q.Q2_K, Q.Q3_K):  # fp16 d (and dmin) last; Q2_K's 4-bit scale x 2-bit code reaches 45 d, Q3_K's 128 d
        low = 1e-3 if qtype is Q.Q2_K else 4e-4
        d = rng.uniform(low, 2 * low, size=(*raw.shape[:2], 2)).astype(np.float16).view(np.uint8)
        raw[..., ts - (4 if qtype is Q.Q2_K else 2) :] = d.reshape(*raw.shape[:2], -1)[..., : 4 if qtype is Q.Q2_K else 2]
        return raw.reshape(w.shape[0], -1)
    low = 1e-5 if qtype is Q.Q6_K else 1e-4  # Q6_K's int8 scales reach 127: keep its weights ~0.05 too
    d = rng.uniform(low, 3 * low, size=raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype is Q.Q6_K:
        raw[..., ts - 2 :] = d  # ql, qh, int8 scales, then d
    else:
        raw[..., 0:2] = d  # d, dmin, 6-bit scales/mins, (qh,) qs
        raw[..., 2:4] = d
    return raw.reshape(w.shape[0], -1)


# Q4_K_M's mix in miniature (llama.cpp's use_more_bits layers): Q4_K, with attn_v and ffn_down in Q6_K, the
# embedding in Q4_K and the output table in Q6_K.
Q4_K_M = {"v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "embed_tokens": Q.Q4_K, "lm_head": Q.Q6_K}


def write_quantised(
    path: Path, qtype: Q, seed: int = 0, overrides: dict[str, Q] | None = None
) -> dict[str, torch.Tensor]:
    """A tiny Llama GGUF, every linear weight in `qtype` except the projections named in `overrides`
    (e.g. "v_proj"), which also names vocabulary tables to quantise ("embed_tokens", "lm_head"; else F32);
    returns the HF state dict it dequantises to (the twin's weights)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(CONFIG)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        ("block_count", 2), ("context_length", 128), ("embedding_length", 256), ("feed_forward_length", 256),
        ("head_count", 4), ("head_count_kv", 2), ("vocab_size", 128),
    ):
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_eos_token_id(3)
    state: dict[str, torch.Tensor] = {}
    for name, p in hf.state_dict().items():
        w = (1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p)).numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{NAMES[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        key = name.split(".")[-2]  # q_proj, ..., embed_tokens, lm_head
        if name.endswith("_proj.weight") or key in (overrides or {}):
            heads = {"q_proj": 4, "k_proj": 2}.get(key)
            t = (overrides or {}).get(key, qtype)
            raw = quantise(w.astype(np.float32), t, rng)
            deq = gguf.quants.dequantize(raw, t).reshape(w.shape)
            stored = raw
            if heads:  # llama.cpp's q/k row permutation, on whole rows of blocks
                stored = raw.reshape(heads, 2, -1, raw.shape[1]).swapaxes(1, 2).reshape(raw.shape)
            writer.add_tensor(gname, stored, raw_dtype=t)
            state[name] = torch.from_numpy(deq.astype(np.float32))
        else:
            writer.add_tensor(gname, w.astype(np.float32))
            state[name] = torch.from_numpy(w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def twin(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_config(CONFIG, attn_implementation="eager").float().eval()
    hf.load_state_dict(state)
    return hf


TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.usefixtures("exact_cpu_kernels")
def test_gguf_type_matches_the_dequantised_twin(qtype: Q, tmp_path: Path) -> None:
    state = write_quantised(tmp_path / "tiny.gguf", qtype)
    ours = load_model(str(tmp_path / "tiny.gguf"), torch.float32, "cpu")
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, GGUFLinearMethod) and qkv.quant_method.kind is QuantMethod.GGUF
    hf = twin(state)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    runner = PagedRunner(ours)
    torch.testing.assert_close(runner.step({0: PROMPT})[0], expected, atol=1e-4, rtol=1e-4)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert PagedRunner(ours).greedy(0, PROMPT, 8) == ref[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_int4_groups_are_exactly_gguf_dequantize(qtype: Q) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, size=(64, 512)).astype(np.float32)
    raw = quantise(w, qtype, rng)
    blocks = GGUFBlocks(qtype, (64, 512), raw)
    q, scale, offset = int4_groups(blocks)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (64, 16)
    torch.testing.assert_close(dequantize(q, scale, offset), blocks.dequantize(), atol=1e-6, rtol=1e-6)


def test_int4_cpu_kernel_path_and_resident_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The int4 kernel path (forced here; the default where the CPU has AVX512-BF16): bf16 scales, so a
    bf16-level tolerance; the weights stay 4-bit (resident within 10 % of the file's Q4_1 bytes)."""
    from agentbox.layers.quant import int4

    state = write_quantised(tmp_path / "tiny.gguf", Q.Q4_1)
    monkeypatch.setattr(int4, "default_cpu_kernel", lambda: Int4Kernel.INT4_CPU)
    ours = load_model(str(tmp_path / "tiny.gguf"), torch.float32, "cpu")
    layers = [m for m in ours.model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    assert layers and all(m.quant_method.kernel is Int4Kernel.INT4_CPU for m in layers)
    with torch.no_grad():
        expected = twin(state)(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours).step({0: PROMPT})[0]
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
    assert got[-1].argmax() == expected[-1].argmax()
    linear_bytes = sum(resident_weight_bytes(m) for m in layers)
    file_bytes = sum(state[n].numel() for n in state if n.endswith("_proj.weight")) // 32 * 20  # Q4_1: 20 B / 32
    assert abs(linear_bytes - file_bytes) <= 0.1 * file_bytes


def test_a_shard_inside_a_block_is_cut_densely() -> None:
    """Row-parallel shards that split a Q4_K block (256 columns) fall back to this rank's dense rows."""
    from agentbox.layers.linear import RowParallelLinear
    from agentbox.layers.quant import QuantConfig, process_weights_after_loading, quant_context
    from agentbox.parallel.state import set_tp_state

    rng = np.random.default_rng(2)
    blocks = GGUFBlocks(Q.Q4_K, (8, 512), quantise(np.zeros((8, 512), np.float32), Q.Q4_K, rng))
    full = blocks.dequantize()
    try:
        for rank, (start, size) in enumerate([(0, 320), (320, 192)]):
            set_tp_state(rank, 2)
            with quant_context(QuantConfig(QuantMethod.GGUF)):
                layer = RowParallelLinear(512, 8, input_shard=(start, size))  # an uneven head split
            load_weight(layer.weight, blocks)
            torch.testing.assert_close(layer.quant_method.dequantized_weight(layer), full[:, start : start + size])
            process_weights_after_loading(layer)
            torch.testing.assert_close(layer.weight.data, full[:, start : start + size])
    finally:
        set_tp_state(0, 1)


@pytest.mark.usefixtures("exact_cpu_kernels")
def test_a_q4_k_m_mix_matches_the_dequantised_twin(tmp_path: Path) -> None:
    """Q4_K q/k beside a Q6_K v in one qkv layer, Q6_K ffn_down: on the exact path every run is dense."""
    state = write_quantised(tmp_path / "tiny.gguf", Q.Q4_K, overrides=Q4_K_M)
    ours = load_model(str(tmp_path / "tiny.gguf"), torch.float32, "cpu")
    with torch.no_grad():
        expected = twin(state)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(ours).step({0: PROMPT})[0], expected, atol=1e-4, rtol=1e-4)


def test_a_mixed_layer_keeps_the_int4_kernel_for_its_4_bit_rows(tmp_path: Path) -> None:
    """On the default CPU kernels a Q4_K_M qkv holds q/k in the int4 kernel's form and v (Q6_K) in the k-bit
    kernel's: both outputs are their kernels' (int8-rounded activations, as llama.cpp)."""
    from agentbox.kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("the CPU kernels do not build here")
    state = write_quantised(tmp_path / "tiny.gguf", Q.Q4_K, overrides=Q4_K_M)
    ours = load_model(str(tmp_path / "tiny.gguf"), torch.float32, "cpu")
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.kernel is None
    assert qkv.segments[0].int4_kernel is Int4Kernel.CPU_SIMD and qkv.segments[1].bits_kernel is BitsKernel.CPU_SIMD
    assert [qkv.segments[0].q4_rows, qkv.segments[1].bits_cpu.n] == [256 + 128, 128]  # q/k rows, then v
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    w = {p: state[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")}
    with torch.no_grad():
        out = qkv(x)
    qk = torch.nn.functional.linear(cpu_gemv.round_activations(x), torch.cat([w["q_proj"], w["k_proj"]]))
    torch.testing.assert_close(out[:, :384], qk, atol=1e-4, rtol=1e-4)
    v = torch.nn.functional.linear(cpu_gemv.round_activations(x), w["v_proj"])
    torch.testing.assert_close(out[:, 384:], v, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        expected = twin(state)(torch.tensor([PROMPT])).logits[0]
    # The vocabulary tables stay quantised too: the Q4_K embedding in the 4-bit kernel's tiles, the Q6_K LM
    # head in the k-bit kernel's rows (the lookup and the head against the file's dequantised tables).
    from agentbox.layers.quant.quant_rows import BitsRows, QuantRows

    embed, head = ours.model.model.embed_tokens, ours.model.lm_head
    assert isinstance(embed.quant, QuantRows) and isinstance(head.quant, BitsRows)
    ids = torch.tensor([[3, 127], [0, 64]])
    torch.testing.assert_close(embed(ids), state["model.embed_tokens.weight"][ids], atol=1e-6, rtol=1e-6)
    head_ref = torch.nn.functional.linear(cpu_gemv.round_activations(x), state["lm_head.weight"])
    torch.testing.assert_close(head(x), head_ref, atol=1e-4, rtol=1e-4)
    # Each layer is its kernel's numbers (above); through the model int8-rounded activations move a tiny
    # random model's near-flat logits (measured: 14 % of their range at most; 11 of 12 positions decided).
    got = PagedRunner(ours).step({0: PROMPT})[0]
    assert_top_tokens_agree(got, expected, max_err=0.25 * expected.abs().max().item(), min_decided=0.5)
