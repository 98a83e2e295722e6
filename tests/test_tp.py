"""Tensor parallel on CPU: two gloo ranks against one, on tiny random Llama / Qwen3 checkpoints and the
embedded SmolLM2 GGUF (whose 3 KV heads split 2 + 1); and a real `serve --tp 2` whose idle tree is
measured, one of whose workers is killed mid-request, and which must come back without orphans."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from agentbox.bench.idle import serve_subprocess, tree_cpu_over
from agentbox.config import EngineConfig
from agentbox.engine.exec.step_inputs import StepInputs
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-6,
)
CONFIGS = {
    "llama": LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]),
    "qwen3": Qwen3Config(**TINY, head_dim=16, architectures=["Qwen3ForCausalLM"]),
}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(37)]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _save(arch: str, path: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[arch]).save_pretrained(path)
    return path


def _config(model: str, tp: int, **kw: object) -> EngineConfig:
    # an fp32 pool: tp 2 equals tp 1 to 1e-4, and the fp16 pool's rounding turns their last-bit differences into 1e-3
    return EngineConfig(model=model, device="cpu", dtype="float32", num_pages=256, tensor_parallel_size=tp,
                        cpu_threads=1, **{"kv_dtype": "float32", **kw})  # type: ignore[arg-type]


def _run(model: str, tp: int) -> dict:
    """Logits, a greedy run, and a batch of 8 mixed-length prompts prefilled in 48-token chunks."""
    prompts = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 17, 40, 64, 90, 130, 5, 200])]
    with LLM(_config(model, tp, max_num_batched_tokens=48)) as llm:
        return {
            "logits": llm.logits(PROMPT),
            "greedy": llm.generate([PROMPT], GREEDY)[0].token_ids,
            "batch": [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                  ignore_eos=True))],
            "weight_bytes": llm.core.runner.weight_bytes_per_rank,
        }


def test_step_inputs_pack_roundtrip() -> None:
    step = StepInputs(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 9]), torch.tensor([16, 17, 41]), [2, 1], [2, 10],
                      torch.tensor([3, 0]), torch.tensor([[3, 0, 1], [0, 2, 2]]), torch.tensor([1, 2]), 1)
    back = StepInputs.unpack(step.pack())
    for name in ("input_ids", "positions", "slot_mapping", "table_rows", "page_updates", "sample_rows"):
        assert torch.equal(getattr(back, name), getattr(step, name)), name
    assert (back.query_lens, back.kv_lens, back.num_table_cols) == ([2, 1], [2, 10], 1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_equals_tp1_tiny(arch: str, tmp_path: Path) -> None:
    model = str(_save(arch, tmp_path / arch))
    one, two = _run(model, 1), _run(model, 2)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    assert two["greedy"] == one["greedy"] and len(one["greedy"]) == 32
    assert two["batch"] == one["batch"]
    # Each rank holds about half the weights (the norms are replicated, everything else is split).
    (full,) = one["weight_bytes"]
    assert len(two["weight_bytes"]) == 2 and all(b < 0.55 * full for b in two["weight_bytes"])


@pytest.mark.slow
def test_smollm2_tp2_equals_tp1(smollm2_path: Path, smollm2_loaded) -> None:  # noqa: ANN001
    ids = [1, 504, 3458, 282, 253, 1345, 30, 198, 504, 3458, 282]  # any tokens: the model is what is compared
    with LLM(_config(str(smollm2_path), 1), smollm2_loaded) as llm:
        ref_logits, ref = llm.logits(ids), llm.generate([ids], GREEDY)[0].token_ids
    with LLM(_config(str(smollm2_path), 2, exact_cpu=True)) as llm:  # smollm2_loaded is the exact path too
        logits, got = llm.logits(ids), llm.generate([ids], GREEDY)[0].token_ids
        per_rank = llm.core.runner.weight_bytes_per_rank
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert got == ref
    assert len(per_rank) == 2 and max(per_rank) < 0.7 * sum(per_rank)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _worker_of(server_pid: int) -> psutil.Process:
    """The tp rank-1 process: a grandchild of the server, spawned by the engine core."""
    for engine in psutil.Process(server_pid).children():
        for p in engine.children():
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline()):
                return p
    raise AssertionError("no tensor-parallel worker found in the server's process tree")


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-tp")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, TINY["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return _save("llama", path)


@pytest.mark.slow
def test_serve_tp2_idle_death_restart(tiny_with_tokenizer: Path) -> None:
    args = ["--tp", "2", "--device", "cpu", "--dtype", "float32", "--num-pages", "512", "--max-num-seqs", "4"]
    with serve_subprocess(str(tiny_with_tokenizer), args) as (url, proc), httpx.Client(base_url=url, timeout=60) as c:
        name = c.get("/health").json()["model"]
        body = {"model": name, "prompt": "w5 w6 w7 w8", "max_tokens": 8, "ignore_eos": True}
        assert c.post("/v1/completions", json=body).status_code == 200
        stats = c.get("/v1/stats").json()["parallel"]
        assert stats["tensor_parallel_size"] == 2 and len(stats["weight_bytes_per_rank"]) == 2
        time.sleep(1.0)
        idle = tree_cpu_over(proc.pid, 10.0)  # psutil cpu_times of server, engine core, worker
        assert len(idle["processes"]) >= 3
        assert idle["percent_of_one_core"] < 1.0, idle

        worker = _worker_of(proc.pid)
        engine = worker.parent()
        result: dict = {}

        def long_request() -> None:
            r = c.post("/v1/completions", json={**body, "max_tokens": 3000})
            result["status"], result["text"] = r.status_code, r.text

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(30)
        assert not t.is_alive(), "the in-flight request hung after a worker died"
        assert time.monotonic() - killed < 10
        assert result["status"] >= 500 and "rank 1" in result["text"], result
        health = c.get("/health")
        assert health.status_code == 503 and "rank 1" in health.text
        deadline = time.monotonic() + 120
        while c.get("/health").status_code != 200:  # the engine restarts on its own
            assert time.monotonic() < deadline, "the engine did not restart"
            time.sleep(0.5)
        assert _gone(worker) and _gone(engine), "the dead engine's processes were left behind"
        assert c.post("/v1/completions", json=body).status_code == 200
        tree = _tree(proc.pid)
    deadline = time.monotonic() + 15
    while not all(_gone(p) for p in tree):
        assert time.monotonic() < deadline, [p for p in tree if not _gone(p)]
        time.sleep(0.2)


def test_doctor_peer_access_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbox.cli.doctor import tp_problems

    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    (no_p2p,) = tp_problems(2, peer=lambda a, b: False, count=2)
    assert no_p2p.severity == "warning" and "NCCL_P2P_DISABLE=1" in no_p2p.fix
    assert tp_problems(2, peer=lambda a, b: True, count=2)[0].severity == "info"
    assert tp_problems(4, peer=lambda a, b: True, count=2)[0].severity == "error"
    assert tp_problems(1) == []


def test_bench_step_reports_both_paths() -> None:
    from agentbox.bench.step_bench import host_step_us

    r = host_step_us(batch=2, context=100, steps=5)
    assert r["host_us"] > 0 and r["legacy_prepare_us"] > 0


def test_bench_decode_step_times_both_attention_paths() -> None:
    from agentbox.bench.step_bench import decode_step_ms

    r = decode_step_ms(context=200, steps=2)  # raises if the view path did not run
    assert r["view_ms"] > 0 and r["gather_ms"] > 0 and r["gather_over_view"] > 0
