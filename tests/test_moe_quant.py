"""Quantised expert methods (layers/experts/int4.py, fp8.py, awq.py, gptq.py) against their definitions, at the layer level."""

from __future__ import annotations

import pytest
import torch

from agentbox.layers.experts import ExpertShard, FusedMoE, MoEActivation, moe_ref, select_experts
from agentbox.layers.experts.fp8 import Fp8BlockExperts
from agentbox.layers.experts.gptq import GptqExperts
from agentbox.layers.experts.int4 import Int4Experts
from agentbox.layers.quant import QuantConfig, QuantMethod
from agentbox.layers.weight_loading import load_weight


def _random_int4(out: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.uint8)
    scale = 0.01 + 0.02 * torch.rand(out, k // group, generator=gen)
    offset = -8 * scale + 0.01 * torch.randn(out, k // group, generator=gen)
    w = q.float().reshape(out, k // group, group) * scale[..., None] + offset[..., None]
    return q, scale, offset, w.reshape(out, k)


@pytest.mark.usefixtures("exact_cpu_kernels")  # the canonical form itself (moe_cpu repacks it by default)
def test_int4_canonical_experts_match_their_dequantised_twin() -> None:
    e, h, i, g = 4, 64, 32, 32
    gen = torch.Generator().manual_seed(0)
    layer = FusedMoE(e, 2, h, i, renormalize=True, method=Int4Experts(g))
    dense13, dense2 = torch.empty(e, 2 * i, h), torch.empty(e, h, i)
    for x in range(e):
        for shard, rows in ((ExpertShard.GATE, slice(0, i)), (ExpertShard.UP, slice(i, 2 * i))):
            q, s, o, w = _random_int4(i, h, g, gen)
            Int4Experts.load_canonical(layer, x, shard, q, s, o)
            dense13[x, rows] = w
        q, s, o, w = _random_int4(h, i, g, gen)
        Int4Experts.load_canonical(layer, x, ExpertShard.DOWN, q, s, o)
        dense2[x] = w
    layer.process_weights_after_loading()
    x = torch.randn(5, h, generator=gen)
    logits = torch.randn(5, e, generator=gen)
    tw, ti = select_experts(logits, 2, True)
    ref = moe_ref(x, tw, ti, lambda n: (dense13[n], dense2[n]), MoEActivation.SILU)
    torch.testing.assert_close(layer(x, logits), ref, atol=1e-5, rtol=1e-5)


def test_int4_experts_refuse_a_shard_off_a_group_boundary() -> None:
    with pytest.raises(ValueError, match="expert intermediate size per rank \\(48\\).*multiple of 32"):
        FusedMoE(2, 1, 64, 48, renormalize=True, method=Int4Experts(32))


@pytest.fixture
def rank1_of_2():  # noqa: ANN201 - layers built inside shard as tp rank 1 of 2 (no collective is run)
    from agentbox.parallel.state import set_tp_state

    set_tp_state(1, 2)
    yield
    set_tp_state(0, 1)


def test_fp8_experts_refuse_a_shard_off_a_block_boundary(rank1_of_2: None) -> None:
    config = QuantConfig(QuantMethod.FP8_BLOCK, 8)
    FusedMoE(2, 1, 128, 256, renormalize=True, method=Fp8BlockExperts(config))  # 128 per rank: whole blocks
    with pytest.raises(ValueError, match="intermediate size per rank \\(64\\).*multiple of 128"):
        FusedMoE(2, 1, 128, 128, renormalize=True, method=Fp8BlockExperts(config))


def test_gptq_act_order_down_shard_splitting_groups_is_refused_by_name(rank1_of_2: None) -> None:
    h, i, g = 128, 256, 128
    config = QuantConfig(QuantMethod.GPTQ, 4, g, desc_act=True)
    layer = FusedMoE(1, 1, h, i, renormalize=True, method=GptqExperts(config), prefix="model.layers.0.mlp.experts")
    gen = torch.Generator().manual_seed(0)
    tensors = {
        ExpertShard.GATE: (i, h, torch.arange(h) // g),
        ExpertShard.UP: (i, h, torch.arange(h) // g),
        ExpertShard.DOWN: (h, i, (torch.arange(i) // g)[torch.randperm(i, generator=gen)]),  # act-order rows
    }
    for shard, (n, k, g_idx) in tensors.items():
        w = "w2" if shard is ExpertShard.DOWN else "w13"
        full = {
            "qweight": torch.zeros(k // 8, n, dtype=torch.int32),
            "qzeros": torch.zeros(k // g, n // 8, dtype=torch.int32),
            "scales": torch.ones(k // g, n, dtype=torch.float16),
            "g_idx": g_idx.to(torch.int32),
        }
        for name, t in full.items():
            param = getattr(layer, f"{w}_{name}")
            load_weight(param, t, 0, shard)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.g_idx: .*whole groups of 128"):
        layer.process_weights_after_loading()


def test_planner_moe_formats_are_the_registered_expert_methods() -> None:
    import agentbox.models.loader  # noqa: F401 - imports every module that registers an expert method
    from agentbox.hub.engine_support import MOE_EXPERT_FORMATS
    from agentbox.layers.experts import registered_expert_methods
    from agentbox.layers.quant.formats import EXPERT_METHODS, METHODS

    infos = METHODS | EXPERT_METHODS
    with_experts = {m for m, info in infos.items() if info.moe_gpu is not None} | {QuantMethod.UNQUANTIZED}
    assert with_experts == registered_expert_methods()
    assert MOE_EXPERT_FORMATS == {f for m in with_experts for f in infos[m].formats}
    assert {"fp8", "awq", "gptq"} <= MOE_EXPERT_FORMATS


def test_byte_packing_is_bit_identical_to_the_word_helpers() -> None:
    from agentbox.layers.experts.awq import awq_to_rows
    from agentbox.layers.experts.int4 import pack_rows_bytes, unpack_rows_bytes
    from agentbox.layers.quant.awq import awq_unpack
    from agentbox.layers.quant.int4 import pack_rows_int32, unpack_rows_int32

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 24), generator=gen, dtype=torch.uint8)
    assert torch.equal(pack_rows_bytes(q), pack_rows_int32(q))
    words = torch.randint(-(2**31), 2**31 - 1, (16, 3), generator=gen, dtype=torch.int32)
    assert torch.equal(unpack_rows_bytes(words), unpack_rows_int32(words))
    assert torch.equal(awq_to_rows(words), pack_rows_int32(awq_unpack(words)))


def test_a_gptq_v2_checkpoint_is_refused_by_its_field() -> None:
    from transformers import LlamaConfig

    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}
    with pytest.raises(ValueError, match="checkpoint_format 'gptq_v2' is not supported"):
        QuantConfig.of(LlamaConfig(quantization_config=qc))


def test_expert_method_follows_the_quant_config_and_its_skip_modules() -> None:
    from agentbox.layers.experts.awq import AwqExperts
    from agentbox.layers.experts.unquantized import UnquantizedExperts
    from agentbox.layers.quant import quant_context

    config = QuantConfig(QuantMethod.AWQ, 4, 32, sym=False, skip_modules=("model.layers.0.mlp.experts",))
    with quant_context(config):
        skipped = FusedMoE(2, 1, 64, 32, renormalize=True, prefix="model.layers.0.mlp.experts")
        quantised = FusedMoE(2, 1, 64, 32, renormalize=True, prefix="model.layers.1.mlp.experts")
    assert isinstance(skipped.method, UnquantizedExperts) and isinstance(quantised.method, AwqExperts)


def test_a_shared_gate_up_g_idx_loads_in_either_order_and_must_agree() -> None:
    config = QuantConfig(QuantMethod.GPTQ, 4, 32, desc_act=True)
    layer = FusedMoE(1, 1, 64, 32, renormalize=True, method=GptqExperts(config), prefix="model.layers.2.mlp.experts")
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    g_idx = layer.w13_g_idx
    load_weight(g_idx, perm, 0, ExpertShard.UP)  # up before gate (another shard file first)
    load_weight(g_idx, perm, 0, ExpertShard.GATE)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.0\.up -> w13_g_idx: differs"):
        load_weight(g_idx, perm.flip(0), 0, ExpertShard.UP)
