"""Shared by the MoE model tests: tiny random checkpoints saved like a download, transformers' logits for
a prompt and a step-by-step decode, and the same steps run at tp 2 in two gloo processes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from model_harness import PagedRunner
from transformers import AutoModelForCausalLM, PretrainedConfig

PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8]
DECODE = [77, 12, 190, 4, 61]  # fed one token at a time after the prompt


def save_random(config: PretrainedConfig, path: Path, seed: int = 0) -> torch.nn.Module:
    """A transformers model with every parameter random (norms near one, sinks and biases too), saved."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


def hf_logits(hf: torch.nn.Module) -> torch.Tensor:
    """[len(PROMPT) + len(DECODE), vocab] float32: every position of prompt + decode tokens."""
    with torch.no_grad():
        return hf(torch.tensor([PROMPT + DECODE])).logits[0].float()


def paged_logits(loaded, page_size: int = 4) -> torch.Tensor:  # noqa: ANN001 - LoadedModel
    """Our logits for the same positions: the prompt as one prefill, then one token per step."""
    runner = PagedRunner(loaded, page_size=page_size)
    out = [runner.step({0: PROMPT})[0]]
    out += [runner.step({0: [t]})[0] for t in DECODE]
    return torch.cat(out)


def _tp_worker(rank: int, world: int, init_file: str, model_dirs: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    from agentbox.layers.quant import int4
    from agentbox.models.loader import load_model
    from agentbox.parallel.state import set_tp_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        set_tp_state(rank, world)
        for m, model_dir in enumerate(model_dirs):
            with int4.cpu_kernel(int4.Int4Kernel.DENSE):  # compared with fp32 twins: the exact CPU path
                loaded = load_model(model_dir, torch.float32, "cpu")
            logits = paged_logits(loaded)
            torch.save(logits, os.path.join(out_dir, f"model{m}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tp_logits(model_dirs: list[Path], world: int = 2) -> list[list[torch.Tensor]]:
    """paged_logits of each model at tensor-parallel size `world` over gloo, one result per rank (all must
    agree). One spawn for all models: starting the processes costs more than the models."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        dirs = [str(d) for d in model_dirs]
        mp.spawn(_tp_worker, args=(world, init_file, dirs, tmp), nprocs=world, join=True)
        return [
            [torch.load(os.path.join(tmp, f"model{m}-rank{r}.pt")) for r in range(world)]
            for m in range(len(dirs))
        ]


def engine_greedy_matches(path: Path, hf: torch.nn.Module, ours, n: int = 12):  # noqa: ANN001, ANN201
    """Our engine's greedy tokens for PROMPT equal transformers' generate; returns the LLM for more checks."""
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    # an fp32 KV pool: the logits are checked against transformers at 1e-4 (the default CPU pool is fp16)
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch", kv_dtype="float32"),
              loaded=ours)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref[0, len(PROMPT) :].tolist()
    return llm
