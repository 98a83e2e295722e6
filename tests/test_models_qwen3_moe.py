"""Qwen3-MoE against transformers with the same random weights: prefill, step-by-step decode, greedy through
the engine, and tensor parallel 2 over gloo (experts split on the intermediate dimension)."""

from __future__ import annotations

import pytest
import torch
from moe_harness import PROMPT, engine_greedy_matches, hf_logits, paged_logits, save_random
from transformers import Qwen3MoeConfig

from agentbox.layers.experts import FusedMoE
from agentbox.models.loader import load_model

TINY_MOE = dict(
    hidden_size=64,
    intermediate_size=96,  # the dense layers' MLP
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
    num_experts=8,
    num_experts_per_tok=2,
    architectures=["Qwen3MoeForCausalLM"],
)

CONFIGS = {
    # layer 1 dense (mlp_only_layers), top-k renormalised
    "norm-topk": Qwen3MoeConfig(**TINY_MOE, norm_topk_prob=True, mlp_only_layers=[1]),
    # every second layer sparse, raw top-k probabilities
    "sparse-step-2": Qwen3MoeConfig(**TINY_MOE, norm_topk_prob=False, decoder_sparse_step=2),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(CONFIGS[request.param], path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


def test_layers_are_sparse_where_the_config_says(tiny) -> None:  # noqa: ANN001
    path, hf, ours = tiny
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in ours.model.model.layers]
    expected = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert sparse == expected and any(sparse) and not all(sparse)


def test_prefill_and_decode_match_transformers(tiny) -> None:  # noqa: ANN001
    _, hf, ours = tiny
    torch.testing.assert_close(paged_logits(ours), hf_logits(hf), atol=1e-4, rtol=1e-4)


def test_engine_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    path, hf, ours = tiny
    llm = engine_greedy_matches(path, hf, ours)
    torch.testing.assert_close(llm.logits(PROMPT), hf_logits(hf)[len(PROMPT) - 1], atol=1e-4, rtol=1e-4)
