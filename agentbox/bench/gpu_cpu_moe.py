"""The GPU check's experts-in-host-RAM block (issue 44; scripts/gpu_check.sh `cpu_moe`): one JSON object.

- parity: a tiny random Qwen3-MoE checkpoint (saved, loaded by our loader) on the GPU with every layer's routed
  experts in host RAM (`--cpu-moe`) against the same model with them on the GPU: greedy tokens (identical in
  fp32), the next-token logits' max |diff| in fp32 and bf16, whether CUDA graphs ran (they cannot with host
  experts).
- decode: a Qwen3-30B-A3B-shaped random GGUF (bench/qwen3_30b_a3b_gguf.py, Q8_0, 2 of its 48 layers) served with
  `--cpu-moe`: attention, router and lm_head on the GPU, the experts on the CPU kernels; decode tok/s at batch 1
  and the share of a step each side takes, from the engine's own clock around the host experts (/v1/stats
  `experts`); the same file with the experts on the GPU in the same run as the baseline.
The same code runs on CPU (tests/test_cpu_moe.py calls it there: a dry run where both sides are the CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from agentbox.bench.throughput import engine_rates, random_prompts
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import to_json

TINY = Qwen3MoeConfig(
    architectures=["Qwen3MoeForCausalLM"], hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
    max_position_embeddings=512, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
)
GENERATOR = Path(__file__).resolve().parents[2] / "bench" / "qwen3_30b_a3b_gguf.py"


def _save_tiny(path: Path) -> None:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(TINY).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    hf.save_pretrained(path)


def parity(device: str, dtype: torch.dtype, new_tokens: int = 16) -> dict[str, Any]:
    """Greedy tokens and next-token logits of the tiny model with its experts in host RAM and without."""
    prompt = random_prompts(1, 24, TINY.vocab_size, seed=3)[0]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
    with tempfile.TemporaryDirectory() as tmp:
        _save_tiny(Path(tmp))
        runs = {}
        for name, cpu_moe in (("device", False), ("host", True)):
            config = EngineConfig(model=tmp, device=device, dtype=out["dtype"], num_pages=32, cpu_moe=cpu_moe,
                                  speculative="off")
            with LLM(config) as llm:
                logits = llm.logits(prompt)
                tokens = llm.generate([prompt], sp)[0].token_ids
                runs[name] = (logits, tokens, llm.core.runner.graphs is not None, to_json(llm.core.stats())["experts"])
    (d_logits, d_tokens, d_graphs, _), (h_logits, h_tokens, h_graphs, h_stats) = runs["device"], runs["host"]
    first = next((i for i, (a, b) in enumerate(zip(d_tokens, h_tokens, strict=True)) if a != b), None)
    return {
        **out,
        "identical_tokens": d_tokens == h_tokens,
        "first_difference": first,
        "max_abs_diff": (h_logits - d_logits).abs().max().item(),
        "max_abs_logit": d_logits.abs().max().item(),
        "top1_match": int(h_logits.argmax()) == int(d_logits.argmax()),
        "cuda_graphs": {"device": d_graphs, "host": h_graphs},
        "host_layers": h_stats["host_layers"],
        "moe_layers": h_stats["moe_layers"],
    }


def decode(gguf: str, device: str, prompt_len: int = 128, new_tokens: int = 64) -> dict[str, Any]:
    """Batch-1 decode of `gguf` with every layer's experts in host RAM and, as the baseline in the same run, on
    the device; the host side's share of a decode step from the engine's clock."""
    out: dict[str, Any] = {}
    for name, cpu_moe in (("cpu_moe", True), ("experts_on_device", False)):
        t0 = time.perf_counter()
        try:
            page = EngineConfig(device=device).resolved_page_size
            llm = LLM(EngineConfig(model=gguf, device=device, num_pages=-(-(prompt_len + new_tokens) // page) + 8,
                                   max_num_seqs=1, cpu_moe=cpu_moe, speculative="off", cache_policy="none"))
        except Exception as e:  # noqa: BLE001 - the baseline may not fit or load: say so, keep the other side
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        with llm:
            load_s = time.perf_counter() - t0
            vocab = llm.loaded.vocab_size
            engine_rates(llm, random_prompts(1, 8, vocab, 0), 4)  # warm-up (Triton compiles here)
            before = to_json(llm.core.stats())["experts"]
            r = engine_rates(llm, random_prompts(1, prompt_len, vocab, 1), new_tokens)
            after = to_json(llm.core.stats())["experts"]
        steps = after["steps"] - before["steps"]
        host_ms = (after["cpu_expert_ms_per_step"] * after["steps"] - before["cpu_expert_ms_per_step"] * before["steps"])
        out[name] = {
            "load_s": load_s, **r.as_dict(), "host_layers": after["host_layers"], "moe_layers": after["moe_layers"],
            "host_bytes": after["host_bytes"], "host_method": after["host_method"],
            # the timed run's steps (its prefill and decode): the CPU experts' ms a step and their share of it
            "cpu_expert_ms_per_step": host_ms / steps if steps else None,
            "last_step_ms": after["last_step_ms"], "last_cpu_expert_ms": after["last_cpu_expert_ms"],
            "decode_step_cpu_share": after["last_cpu_expert_ms"] / after["last_step_ms"] if after["last_step_ms"] else None,
        }
    return out


def report(layers: int = 2) -> dict[str, Any]:
    device = "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        gguf = str(Path(tmp) / "q30b-q8_0.gguf")
        subprocess.run([sys.executable, str(GENERATOR), gguf, "--type", "q8_0", "--layers", str(layers)], check=True,
                       stdout=subprocess.DEVNULL)
        return {
            "gpu": torch.cuda.get_device_name(0),
            "parity": [parity(device, torch.float32), parity(device, torch.bfloat16)],
            f"qwen3_30b_a3b_shape_{layers}_layers_q8_0_decode": decode(gguf, device),
        }


if __name__ == "__main__":  # python -m agentbox.bench.gpu_cpu_moe (scripts/gpu_check.sh's cpu_moe block)
    print(json.dumps(report(), indent=2))
