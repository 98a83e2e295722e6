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


def test_bench_tiny_model_agent_makes_the_turn_ending_model_at_the_context_asked(tmp_path: Path,
                                                                               smollm2_tokenizer) -> None:  # noqa: ANN001
    """The shipped way to try a real client on a CPU box (docs/clients.md): its model ends every turn at once."""
    import json

    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    out = tmp_path / "tiny-agent"
    r = CliRunner().invoke(app, ["bench", "tiny-model", str(out), "--agent", "--context", "4096"])
    assert r.exit_code == 0, r.output
    assert "saved a tiny turn-ending model with 4,096 positions" in r.output and "--max-model-len 4096" in r.output
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 4096
    with LLM(EngineConfig(model=str(out), device="cpu")) as llm:
        chat = [{"role": "user", "content": "hi"}]
        prompt = list(smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
        done = llm.generate([prompt], SamplingParams(max_tokens=16))[0]
    assert done.token_ids == [smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")] and done.finish_reason == "stop"
    again = CliRunner().invoke(app, ["bench", "tiny-model", str(out), "--agent"])
    assert again.exit_code == 1 and "is not empty" in again.output
    hybrid = CliRunner().invoke(app, ["bench", "tiny-model", str(tmp_path / "h"), "--agent", "--kind", "hybrid"])
    assert hybrid.exit_code == 1 and "dense model only" in hybrid.output
