"""The GPU check's MTP block (agentbox/bench/gpu_mtp.py) on the CPU at the tiny Qwen3.5 shape: the same code builds
the random model with transformers, decodes with drafts off, trains the head on those continuations, saves it in
the released layout and decodes again with `--speculative mtp`. In fp32 the tokens must be the same and the
trained head must get drafts accepted. On a GPU the block runs at Qwen3.8-27B's shape (4 layers) in bf16."""

from __future__ import annotations

from hybrid_models import configs

from agentbox.bench.gpu_mtp import qwen3_8_27b_config, report


def test_the_block_runs_at_a_tiny_shape_on_cpu() -> None:
    out = report("cpu", "float32", configs()["qwen3_5"], prompts=2, prompt_len=12, new_tokens=24, steps=200)
    d = out["decode_batch_1"]
    assert d["same_tokens"], d
    assert d["drafted"] > 0 and d["accepted"] > 0, d
    assert d["off_tok_s"] > 0 and d["mtp_tok_s"] > 0
    first, last = out["train"]["loss_first_last"]
    assert last < 0.75 * first, out["train"]  # 0.02-scale weights: small logits, a slow start at this shape


def test_the_gpu_shape_is_qwen3_8_27b_with_four_layers() -> None:
    t = qwen3_8_27b_config().get_text_config()
    assert (t.hidden_size, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (
        5120, 17408, 24, 4, 256)
    assert (t.linear_num_key_heads, t.linear_num_value_heads, t.vocab_size) == (16, 48, 248320)
    assert t.layer_types == ["linear_attention"] * 3 + ["full_attention"]
