"""The engine's memory ceiling (engine/memory_ceiling.py) turns a runaway allocation into one request's error.

In a process of its own (the ceiling is process-wide): an engine over SmolLM2 under the ceiling is handed the
recursive schema the API gate refuses (the grammar forces `{"child": {"child": ...` without end), directly, as a
bug in the gate would hand it. Its closer asks xgrammar for that endless forced output and the allocation fails
at the ceiling, not at the machine's end: that request ends with an error, the next one is served."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, sys, time
    from agentbox.config import EngineConfig
    from agentbox.engine import memory_ceiling
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams
    from agentbox.chat.grammar import grammar_spec
    from agentbox.models.loader import load_tokenizer, resolve_model

    model = sys.argv[1]
    llm = LLM(EngineConfig(model=model, device="cpu", num_pages=64, max_model_len=1024, speculative="off",
                           memory_margin_gb=0.5))
    ceiling = memory_ceiling.apply(llm.core.config)
    schema = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    prompt = load_tokenizer(resolve_model(model)).encode("Call the tool f.")
    t0 = time.monotonic()
    bad = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                grammar=grammar_spec(tools, "required", None, "hermes")))[0]
    took = time.monotonic() - t0
    good = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    print(json.dumps({"ceiling": ceiling, "held": memory_ceiling.data_bytes(), "bad": bad.finish_reason,
                      "error": bad.error, "took": took, "good": good.finish_reason, "tokens": len(good.token_ids)}))
""")


def test_a_runaway_grammar_fails_its_request_at_the_ceiling(smollm2_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(smollm2_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out)
    assert out["ceiling"] is not None
    assert out["bad"] == "error" and "bad_alloc" in out["error"], out
    assert out["good"] in ("stop", "length") and out["tokens"] > 0  # the engine goes on
