"""Kernel tests run on CUDA where there is one, else on CPU under Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, that is when its module is first imported; this
conftest is imported before the test modules of this folder, and nothing outside tests/kernels imports a
kernel module, so setting it here reaches every kernel. It is left unset on a CUDA machine.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - LoadedModel
    """A tiny random Qwen3 (GQA 4: 8 query heads, 2 KV heads), saved and loaded through our loader."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from agentbox.models.loader import load_model

    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny-qwen3")
    hf.save_pretrained(path)
    return load_model(str(path), torch.float32, DEVICE)
