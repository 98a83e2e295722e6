"""A tiny Qwen3.5 checkpoint with a multi-token-prediction head in the released layout (`mtp.*` beside the
model's file; config `text_config.mtp_num_hidden_layers: 1`), and its head trained on the tiny model's own greedy
outputs. The head's weights, its plain-torch twin and the training loop are agentbox/bench/mtp_head.py (the GPU
check's MTP block trains one at Qwen3.8-27B's shape with the same code)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hybrid_models import configs, save_hybrid
from safetensors.torch import save_file

from agentbox.bench.mtp_head import random_mtp, train_head


def text_config() -> Any:
    return configs()["qwen3_5"].get_text_config()


def save_with_mtp(path: Path, mtp: dict[str, torch.Tensor] | None = None, seed: int = 0,
                  family: str = "qwen3_5") -> torch.nn.Module:
    """The tiny Qwen3.5 (or Qwen3.5-MoE) of hybrid_models.py plus an MTP head: `mtp.safetensors` beside the
    model's file, and `mtp_num_hidden_layers` in its text config, as the released checkpoints have them. The MoE
    head's layer is the model's attention layer's tensors under `mtp.layers.0.` (its experts, router and shared
    expert named as transformers saves the model's own), with random fc and norms."""
    hf = save_hybrid(configs()[family], path, seed)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = mtp if mtp is not None else random_mtp(hf.config.get_text_config())
    if family != "qwen3_5" and mtp is None:
        from safetensors.torch import load_file

        layer = "model.language_model.layers.3."
        trunk_tensors = load_file(str(path / "model.safetensors"))
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.layers.0.")}
        tensors |= {"mtp.layers.0." + k[len(layer):]: v for k, v in trunk_tensors.items() if k.startswith(layer)}
    save_file({k: v.detach().contiguous().float() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return hf


def trunk(hf: torch.nn.Module, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states after the model's norm [B, T, H], the LM head's weight) of the transformers model, for
    sequences of one length (one batched forward: its delta-rule fallback costs seconds a call on a CPU)."""
    with torch.no_grad():
        out = hf.model.language_model(input_ids=torch.tensor(seqs))
    return out.last_hidden_state.float(), hf.lm_head.weight.float()


def engine_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Prompt + n greedy tokens each, decoded by our engine (exact against transformers on this model, and
    seconds faster than its generate on a CPU)."""
    from agentbox.config import EngineConfig, Speculative
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    config = EngineConfig(model=str(path), attention="torch", speculative=Speculative.OFF, host_cache_gb=0.0,
                          num_pages=256)
    with LLM(config) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


def train_mtp(hf: torch.nn.Module, path: Path, prompts: list[list[int]], steps: int = 300, new_tokens: int = 40,
              seed: int = 0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The head trained on the model's own greedy outputs: at each position p of a greedy sequence it reads the
    model's hidden state at p and the token at p + 1 and learns the token at p + 2. Returns its weights and the
    loss at the first and the last step."""
    text = hf.config.get_text_config()
    embed = hf.model.language_model.embed_tokens.weight.detach().float()
    data = []  # (tokens, hidden) per sequence; one trunk forward per length
    by_length: dict[int, list[list[int]]] = {}
    for seq in engine_greedy(path, prompts, new_tokens):
        by_length.setdefault(len(seq), []).append(seq)
    for group in by_length.values():
        hidden, head = trunk(hf, group)
        data += [(torch.tensor(seq), hidden[b]) for b, seq in enumerate(group)]
    return train_head(text, embed, head, data, steps, seed)


# Prompts the tests decode; the head is trained on the model's greedy continuations of all of them (a tiny random
# model's next tokens follow no pattern a head could generalise from 300 steps: on prompts it never saw it drafts
# nothing the model keeps).
BASE = [(7 * i + 3) % 250 + 1 for i in range(12)]
PROMPTS = [BASE * 3, BASE[:5] * 4 + [9, 8, 7]]
TRAIN = [[(7 * i + 11 * j) % 250 + 1 for i in range(10)] for j in range(6)] + PROMPTS
PROSE = [(13 * i + 5) % 250 + 1 for i in range(16)]  # repeats nothing: a text match finds no draft


def bench_workloads(path: Path, new_tokens: int = 40) -> dict[str, list[int]]:
    """`agentbox bench spec --workloads`: prose, and an edit-shaped prompt that re-sends the model's earlier
    answer (the prompt, the answer, the prompt again), as an agent re-sends a file."""
    answer = engine_greedy(path, [PROSE[:10]], new_tokens)[0]
    return {"prose": PROSE, "edit": answer + PROSE[:10]}


def trained_checkpoint(path: Path, steps: int = 300) -> tuple[torch.nn.Module, dict[str, list[int]], list[float], float]:
    """The tiny Qwen3.5 with its head trained on its own greedy continuations of TRAIN and the bench workloads:
    (the transformers model, the workloads, the first and last loss, the seconds training took)."""
    import time

    hf = save_with_mtp(path)
    workloads = bench_workloads(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 64-wide matrices: threads cost more than they give on a shared CPU
    t0 = time.monotonic()
    try:
        weights, losses = train_mtp(hf, path, TRAIN + list(workloads.values()), steps=steps)
    finally:
        torch.set_num_threads(threads)
    seconds = time.monotonic() - t0
    save_with_mtp(path, weights)
    return hf, workloads, losses, seconds
