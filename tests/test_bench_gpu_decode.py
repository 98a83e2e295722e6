"""The GPU decode report's assembly, run on CPU at a tiny shape with the torch backend (scripts/gpu_check.sh
runs it on a GPU at Qwen3-8B's shape): every number comes from a real run, backends without graphs say so."""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from agentbox.bench.gpu_decode import Shape, gpu_decode_report, published_bandwidth


def test_gpu_decode_report_on_cpu_tiny_shape() -> None:
    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=128,
    )
    shape = Shape(config, device="cpu", dtype=torch.float32, batches=(1, 2), prompt_len=6, new_tokens=4)
    report = gpu_decode_report(shape, backends=("torch", "nope"))
    eager = report["engine"]["torch/eager"]
    assert eager["attention_backend"] == "torch" and not eager["cuda_graphs"]
    assert eager["batch_1"]["decode_tok_s"] > 0 and eager["batch_2"]["new_tokens"] == 4
    assert "no CUDA-graph support" in report["engine"]["torch/graphs"]["skipped"]
    assert report["engine"]["nope"] == {"skipped": "not installed"}
    assert report["transformers"]["batch_2"]["decode_tok_s"] > 0
    ceiling = report["bandwidth_at_batch_1"]
    assert ceiling["weight_bytes"] > 0 and ceiling["published_bandwidth_bytes_s"] is None
    assert 0 < ceiling["torch/eager"]["fraction_of_measured_copy"]
    assert set(report["ratios"]) == {"torch/eager_batch_1_over_transformers", "torch/eager_batch_2_over_transformers"}
    assert published_bandwidth("NVIDIA H200") == 4.8e12
