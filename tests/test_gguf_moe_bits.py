"""GGUF MoE experts that are not 4-bit stay quantised in the k-bit form (layers/experts/bits.py): a tiny random
qwen3moe written with gguf's writer, one (gate, up, down) expert type per layer (every k-bit type, Q4_K_M's
Q4_K gate/up with a Q6_K down, and gate/up of different types), loaded by our loader and compared with
transformers on the dequantised twin (fp32); resident expert bytes near the file's; each tp rank's shard."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from model_harness import PagedRunner
from moe_harness import PROMPT, hf_logits, paged_logits
from test_gguf_moe import FFN, E, H, Q, qwen3moe_config, twin, write_qwen3moe
from test_quant_gguf import quantise

from agentbox.layers.experts import ExpertShard, FusedMoE
from agentbox.layers.experts.bits import BitsExperts, BitsForm
from agentbox.layers.experts.gguf import GGUFExperts
from agentbox.layers.quant import resident_weight_bytes
from agentbox.layers.quant.gguf import GGUFBlocks
from agentbox.layers.weight_loading import load_weight
from agentbox.models.loader import load_model
from agentbox.parallel.state import set_tp_state

# The exact CPU path: experts stay in the k-bit form (the default repacks them: tests/test_moe_cpu.py).
pytestmark = pytest.mark.usefixtures("exact_cpu_kernels")
SINGLE = [Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.Q5_1]
LAYER_TYPES = [(t,) * 3 for t in SINGLE] + [
    (Q.Q4_K, Q.Q4_K, Q.Q6_K),  # Q4_K_M's layers with a Q6_K ffn_down_exps
    (Q.Q4_K, Q.Q6_K, Q.Q5_0),  # gate and up differ: w13 promoted to 6 bits, groups of 16, an offset
    (Q.Q5_0, Q.Q8_0, Q.Q4_0),  # two symmetric widths: w13 at 8 bits, still symmetric; an int4-form down
]
SYM, OFF = False, True
FORMS = [  # (w13, w2) per layer
    *[(BitsForm(8, 32, SYM),) * 2, (BitsForm(6, 16, SYM),) * 2, (BitsForm(5, 32, OFF),) * 2,
      (BitsForm(5, 32, SYM),) * 2, (BitsForm(5, 32, OFF),) * 2],
    (BitsForm(4, 32, OFF), BitsForm(6, 16, SYM)),
    (BitsForm(6, 16, OFF), BitsForm(5, 32, SYM)),
    (BitsForm(8, 32, SYM), BitsForm(4, 32, OFF)),
]
CONFIG = qwen3moe_config(len(LAYER_TYPES))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3moe-bits") / "tiny-qwen3moe-bits.gguf"
    return path, twin(write_qwen3moe(path, seed=1, layer_types=LAYER_TYPES), CONFIG)


def _experts(loaded) -> list[FusedMoE]:  # noqa: ANN001 - LoadedModel
    return [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]


def test_kbit_experts_match_the_dequantised_twin(tiny) -> None:  # noqa: ANN001
    path, hf = tiny
    ours = load_model(str(path), torch.float32, "cpu")
    moes = _experts(ours)
    assert all(isinstance(m.method, BitsExperts) for m in moes)
    assert [(m.method.forms["w13"], m.method.forms["w2"]) for m in moes] == FORMS
    assert not hasattr(moes[0], "w13_offset") and moes[2].w13_offset.dtype == torch.float32
    torch.testing.assert_close(paged_logits(ours), hf_logits(hf), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert PagedRunner(ours).greedy(0, PROMPT, 8) == ref[0, len(PROMPT) :].tolist()


def _file_bytes(types: tuple[Q, Q, Q]) -> int:
    return sum(E * FFN * H // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1] for t in types)


def test_kbit_experts_stay_near_the_file_size(tiny) -> None:  # noqa: ANN001
    """bf16: codes at their width plus a bf16 scale (and offset) per group. Q8_0 / Q5_0 / Q5_1 are exactly
    the file's size (34 / 22 / 24 bytes per 32), Q6_K 14 per 16 for 13.125 (1.067x), Q5_K 24 per 32 for 22
    (1.091x), the Q4_K_M layer 1.092x; every single-type layer and the Q4_K_M one within 10 %."""
    ours = load_model(str(tiny[0]), torch.bfloat16, "cpu")
    ratios = [resident_weight_bytes(m) / _file_bytes(t) for m, t in zip(_experts(ours), LAYER_TYPES, strict=True)]
    q4_k_m = (2 * 20 / 32 + 14 / 16) / (2 * 18 / 32 + 13.125 / 16)
    assert ratios[:6] == pytest.approx([1.0, 14 / 13.125, 24 / 22, 1.0, 1.0, q4_k_m], rel=1e-9)
    assert max(ratios[:6]) < 1.10


def test_each_rank_holds_its_half_of_every_expert(tiny) -> None:  # noqa: ANN001
    """The shards without processes: rank r's k-bit experts dequantise to rows [r*I/2, (r+1)*I/2) of the
    twin's gate and up and the same columns of its down (128 of a K-quant block's 256, cut at a group)."""
    path, hf = tiny
    half = FFN // 2
    try:
        for rank in (0, 1):
            set_tp_state(rank, 2)
            ours = load_model(str(path), torch.float32, "cpu")
            for layer, (moe, ref) in enumerate(zip(_experts(ours), hf.model.layers, strict=True)):
                assert isinstance(moe.method, BitsExperts)
                gate_up, down = ref.mlp.experts.gate_up_proj, ref.mlp.experts.down_proj
                rows = torch.cat([torch.arange(half) + rank * half, FFN + torch.arange(half) + rank * half])
                for e in range(E):
                    w13, w2 = moe.method.dequantized_expert(moe, e, torch.float32)
                    torch.testing.assert_close(w13, gate_up[e, rows], atol=1e-6, rtol=0, msg=f"layer {layer} w13")
                    torch.testing.assert_close(
                        w2, down[e, :, rank * half : (rank + 1) * half], atol=1e-6, rtol=0, msg=f"layer {layer} w2"
                    )
    finally:
        set_tp_state(0, 1)


def test_a_down_shard_off_its_groups_is_refused() -> None:
    """tp 32 leaves each rank 8 of a Q6_K down's 256 columns: half a 16-column group. Refused, naming it."""
    rng = np.random.default_rng(0)
    try:
        set_tp_state(0, 32)
        layer = FusedMoE(1, 1, H, FFN, renormalize=True, method=GGUFExperts(), prefix="model.layers.0.mlp.experts")
        for shard, qtype, shape in ((ExpertShard.GATE, Q.Q8_0, (FFN, H)), (ExpertShard.UP, Q.Q8_0, (FFN, H)),
                                    (ExpertShard.DOWN, Q.Q6_K, (H, FFN))):
            raw = quantise(0.05 * rng.standard_normal(shape).astype(np.float32), qtype, rng)
            param = layer.w2_weight if shard is ExpertShard.DOWN else layer.w13_weight
            load_weight(param, GGUFBlocks(qtype, shape, raw), 0, shard)
        with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: GGUF Q6_K experts \(down, ffn_down_exps\)"
                                             r".* 8 input columns .* 16-column groups"):
            layer.process_weights_after_loading()
    finally:
        set_tp_state(0, 1)
