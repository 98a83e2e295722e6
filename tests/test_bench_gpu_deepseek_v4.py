"""The GPU check's DeepSeek-V4 block (agentbox/bench/gpu_deepseek_v4.py) on the CPU at a tiny shape: the same code
that builds the random model with transformers, loads it like a download and reports logits against
transformers and decode tok/s; in fp32 here, so the logits agree to rounding. On a GPU the block runs at
DeepSeek-V4-Flash's shape (4 layers, 16 experts) in bf16 (scripts/gpu_check.sh)."""

from __future__ import annotations

from deepseek_v4_models import tiny_config

from agentbox.bench.gpu_deepseek_v4 import flash_config, report


def test_the_block_runs_at_a_tiny_shape_on_cpu() -> None:
    out = report("cpu", "float32", tiny_config(), prompts=(20, 90), new_tokens=4)
    for kind in ("vs_transformers_fp32", "vs_transformers_bf16"):
        for n in (20, 90):
            assert set(out["logits_float32"][kind][f"prompt_{n}"]) == {"max_abs_diff", "max_abs_ref", "top1_match"}
    fp32 = out["logits_float32"]["vs_transformers_fp32"]
    assert all(v["max_abs_diff"] < 1e-4 * max(1.0, v["max_abs_ref"]) and v["top1_match"] for v in fp32.values())
    assert out["decode_batch_1"]["decode_tok_s"] > 0 and out["layers"] == 4


def test_the_gpu_shape_is_flash_with_four_layers() -> None:
    c = flash_config()
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank) == (
        4096, 64, 512, 1024, 8, 1024)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window, c.hc_mult) == (64, 128, 512, 128, 4)
    assert c.layer_types.count("compressed_sparse_attention") == 2 and c.moe_intermediate_size == 2048
