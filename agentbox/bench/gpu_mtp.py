"""The GPU check's MTP block (scripts/gpu_check.sh): one JSON object.

A random dense model of Qwen3.8-27B's shape (`Qwen3_5ForConditionalGeneration`: hidden 5120, SwiGLU 17408, Gated
DeltaNet with 16 key / 48 value heads of 128, gated attention with 24 query / 4 KV heads of 256, vocab 248,320)
with 4 of its 64 layers (3 Gated DeltaNet + 1 attention, the released pattern), built by transformers on the
device and saved like a download; then an MTP head (`mtp.*`, the released layout) trained for `steps` Adam steps
on the model's own greedy continuations of the prompts (agentbox/bench/mtp_head.py: a random model's next
tokens follow no pattern, so a head is only worth measuring on what it was trained on) and saved beside it.
Reported: decode tok/s at batch 1 through the engine with `--speculative off` and `mtp` on those prompts, the
drafts accepted a step, whether the tokens are the same, and the training's first and last loss.

On a 4-layer model the head's layer is a fifth of a step; on the 64-layer 27B it is about 1/65, so the speedup
here understates the real model's. Imports no HTTP stack. `python -m agentbox.bench.gpu_mtp`; about 8 GB of bf16
weights on the GPU and disk, 10 GB of fp32 embedding and LM head for the training.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from agentbox.bench.mtp_head import train_head
from agentbox.bench.throughput import built, engine_rates, random_prompts
from agentbox.config import GPU_PAGE_SIZE, EngineConfig, Speculative
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams


def qwen3_8_27b_config(layers: int = 4) -> PretrainedConfig:
    """Qwen3.8-27B's text shape with fewer layers (every 4th one attention), a one-block vision tower."""
    text = dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=layers, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
    )
    vision = dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=5120, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=1)
    return Qwen3_5Config(text_config=text, vision_config=vision, architectures=["Qwen3_5ForConditionalGeneration"])


def _random_hf(config: PretrainedConfig, dtype: torch.dtype, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = built(Qwen3_5ForConditionalGeneration, config, dtype, device)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -2.0)  # decays of 0.9 to 0.99 a token
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.normal_(0.0, 0.02)
    return hf.eval()


def _engine(path: str, device: str, dtype: str, spec: Speculative, pages: int) -> LLM:
    return LLM(EngineConfig(model=path, device=device, dtype=dtype, speculative=spec, num_pages=pages, max_num_seqs=4,
                            cache_policy="none", host_cache_gb=0.0))


def _decode(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy tokens per prompt, then the batch-1 decode rate over the prompts one at a time, and the drafts."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens = [c.token_ids for c in llm.generate(prompts, sp)]
    c = llm.core.counters
    drafted, accepted, steps = c.drafted_tokens, c.accepted_tokens, c.steps
    rates = [engine_rates(llm, [p], new_tokens) for p in prompts]
    decode_s = sum(r.decode_s for r in rates)
    return {"tokens": tokens, "decode_tok_s": round(len(prompts) * (new_tokens - 1) / decode_s, 1),
            "drafted": c.drafted_tokens - drafted, "accepted": c.accepted_tokens - accepted,
            "steps": c.steps - steps}


def report(device: str = "cuda", dtype: str = "bfloat16", config: PretrainedConfig | None = None, prompts: int = 4,
           prompt_len: int = 32, new_tokens: int = 64, steps: int = 300) -> dict[str, Any]:
    config = config or qwen3_8_27b_config()
    text = config.get_text_config()
    torch_dtype = getattr(torch, dtype)
    ids = random_prompts(prompts, prompt_len, text.vocab_size, seed=3)
    pages = 4 * -(-(prompt_len + new_tokens + 8) // GPU_PAGE_SIZE) + 16
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else device,
                           "layers": text.num_hidden_layers, "dtype": dtype}
    with tempfile.TemporaryDirectory(prefix="agentbox-mtp-") as tmp:
        t0 = time.perf_counter()
        hf = _random_hf(config, torch_dtype, device)
        hf.save_pretrained(tmp)
        with _engine(tmp, device, dtype, Speculative.OFF, pages) as llm:
            off = _decode(llm, ids, new_tokens)
        seqs = [p + t for p, t in zip(ids, off["tokens"], strict=True)]
        with torch.no_grad():  # the trunk's final hidden states (after its norm) at every position
            hidden = hf.model.language_model(input_ids=torch.tensor(seqs, device=device)).last_hidden_state.float()
        embed = hf.model.language_model.embed_tokens.weight.detach().float()
        head = hf.lm_head.weight.detach().float()
        del hf
        data = [(torch.tensor(s, device=device), hidden[b].clone()) for b, s in enumerate(seqs)]
        t1 = time.perf_counter()
        weights, losses = train_head(text, embed, head, data, steps)
        out["train"] = {"steps": steps, "seconds": round(time.perf_counter() - t1, 1),
                        "loss_first_last": [round(x, 3) for x in losses]}
        del embed, head, data, hidden
        save_file({k: v.to(torch_dtype).cpu().contiguous() for k, v in weights.items()},
                  str(Path(tmp) / "mtp.safetensors"))
        cfg_path = Path(tmp) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["text_config"]["mtp_num_hidden_layers"] = 1  # as the released checkpoints declare their head
        cfg_path.write_text(json.dumps(cfg, indent=2))
        if device == "cuda":
            torch.cuda.empty_cache()
        with _engine(tmp, device, dtype, Speculative.MTP, pages) as llm:
            mtp = _decode(llm, ids, new_tokens)
        out["build_train_s"] = round(time.perf_counter() - t0, 1)
    out["decode_batch_1"] = {
        "off_tok_s": off["decode_tok_s"], "mtp_tok_s": mtp["decode_tok_s"],
        "speedup": round(mtp["decode_tok_s"] / off["decode_tok_s"], 3),
        "drafted": mtp["drafted"], "accepted": mtp["accepted"],
        # over the engine steps of the greedy run (its prefill step included): the tokens a step gains
        "accepted_per_step": round(mtp["accepted"] / max(1, mtp["steps"]), 3),
        # bf16 verify of several rows can round differently from one-row decode; fp32 must match exactly
        "same_tokens": mtp["tokens"] == off["tokens"],
    }
    return out


if __name__ == "__main__":  # python -m agentbox.bench.gpu_mtp (scripts/gpu_check.sh's mtp block)
    print(json.dumps(report(), indent=2))
