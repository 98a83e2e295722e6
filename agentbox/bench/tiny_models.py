"""Tiny random checkpoints to replay agent traces on, where the server's caching is measured and not the model.

`agentbox bench replay --tiny` spawns agentbox on two of them, built here with transformers' own config
classes and saved in the released layout with SmolLM2's tokenizer and chat template (so the replayed
conversations tokenize like a real model's):
- hybrid: a Qwen3.5 (`Qwen3_5ForConditionalGeneration`, a one-block vision tower skipped at load), 4 layers in
  the released 3:1 pattern (3 Gated DeltaNet layers, 1 gated attention layer): its history is resumable only
  where a recurrent-state snapshot was taken;
- dense: a Qwen3 of the same width and depth, every layer attention: its history is resumable at any page.
The same trace against both shows whether the hybrid's snapshots keep its recomputed share of history down
to the dense model's.

A random model never emits end-of-turn, so a real client's turn never ends on it. `save_turn_ending` makes one
that ends every turn at once (`agentbox bench tiny-model --agent`): the way to try Claude Code, Codex, opencode
or aider for real on a CPU box, at any context length, in seconds and without downloading weights.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentbox.bench.spawn import Target


class TinyKind(Enum):
    HYBRID = "hybrid"
    DENSE = "dense"


# the layer shapes of tests/hybrid_models.py (what the hybrid tests check against transformers)
_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
               temporal_patch_size=2, spatial_merge_size=1)
MAX_POSITIONS = 16384


def save_tiny(kind: TinyKind, d: Path, tokenizer: Any, max_positions: int = MAX_POSITIONS) -> Path:
    """A random `kind` model with `tokenizer`, saved with save_pretrained into `d`; returns `d`."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tokenizer), max_position_embeddings=max_positions, eos_token_id=eos)
    torch.manual_seed(0)
    model: torch.nn.Module
    if kind is TinyKind.HYBRID:
        cfg = Qwen3_5Config(text_config={**_TEXT, **common}, vision_config=_VISION,
                            architectures=["Qwen3_5ForConditionalGeneration"])
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        dense = {k: v for k, v in _TEXT.items() if not k.startswith("linear_")}
        model = Qwen3ForCausalLM(Qwen3Config(**dense, **common, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "A_log" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return d


def save_turn_ending(d: Path, tokenizer: Any, max_positions: int) -> Path:
    """A tiny random Qwen3 with `tokenizer` (SmolLM2's: its chat template and `<|im_end|>`) that ends every turn
    after its first token, saved in the released layout into `d`. The residual stream stays the embedding
    (attention and MLP write nothing) and dimension 0 is a constant that only the end-of-turn row of the head
    reads. Its KV is 256 bytes a token in fp32 (one layer, 2 kv heads of 16): a 128k context takes 32 MiB."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions, eos_token_id=eot, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eot, 0] = 30.0
    model.save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return d


def smollm2_tokenizer() -> Any:
    """The embedded SmolLM2's tokenizer (its chat template): what every tiny model here is saved with."""
    from agentbox.hub.embedded import INSTALL_HINT, embedded_model_path
    from agentbox.models.loader import load_tokenizer, resolve_model

    gguf = embedded_model_path()
    if gguf is None:
        raise RuntimeError(f"the tiny models take the embedded SmolLM2's tokenizer: {INSTALL_HINT}")
    return load_tokenizer(resolve_model(str(gguf)))


def tiny_targets(models_dir: Path, policies: list[str], serve_args: list[str]) -> list[Target]:
    """agentbox on the tiny hybrid and the tiny dense model, once per cache policy: `tiny-KIND-POLICY`."""
    from agentbox.bench.spawn import agentbox_target

    tok = smollm2_tokenizer()
    targets = []
    for kind in TinyKind:
        path = save_tiny(kind, models_dir / f"tiny-{kind.value}", tok)
        for policy in policies:
            t = agentbox_target(str(path), policy, serve_args)
            targets.append(dataclasses.replace(t, name=f"tiny-{kind.value}-{policy}",
                                               meta={**t.meta, "model_kind": kind.value}))
    return targets
