"""`agentbox bench replay --tiny`'s models: a hybrid and a dense checkpoint of one width, SmolLM2's tokenizer,
that our loader serves like a download (the replay itself is bench/results/hybrid-replay/)."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from agentbox.bench.tiny_models import TinyKind, save_tiny
from agentbox.cli.main import app
from agentbox.models.loader import load_model


def test_tiny_models_load_as_hybrid_and_dense(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    loaded = {k: load_model(str(save_tiny(k, tmp_path / k.value, smollm2_tokenizer)), torch.float32, "cpu")
              for k in TinyKind}
    hybrid, dense = loaded[TinyKind.HYBRID], loaded[TinyKind.DENSE]
    assert hybrid.layout.state is not None and len(hybrid.layout.state.specs) == 3  # 3 delta-net layers
    assert hybrid.num_layers == 1  # 1 with KV
    assert dense.layout.state is None and dense.num_layers == 4
    assert hybrid.vocab_size == dense.vocab_size == len(smollm2_tokenizer)
    assert hybrid.eos_token_ids == dense.eos_token_ids == [smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_replay_names_tiny_among_its_targets() -> None:
    r = CliRunner().invoke(app, ["bench", "replay", "--sessions", "1", "--turns", "1"])
    assert r.exit_code != 0 and "--tiny" in r.output
