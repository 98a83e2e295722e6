"""Shared test fixtures, and the run's isolation from the user's own agentbox."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from agentbox.config import CPU_PAGE_SIZE
from agentbox.hub.embedded import INSTALL_HINT, embedded_model_path

# Tests never read or write the user's state: agentbox's state directory (server.json, server.log, models and
# partial downloads, setup records) and the coding clients' config files live, for the whole run and every
# process it starts, under a fake AGENTBOX_HOME and HOME made here (a test that starts a server still gives it
# its own). A user's server on port 8000 or a half-pulled model under ~ changes no result
# (tests/test_isolation.py starts one and leaves one, then runs the tests they once broke).
# What stays the user's: caches and tool settings a test only reads. The CPU kernels' build cache is
# ~/.cache/agentbox/kernels: each server a test spawned compiled the kernels again, about 45 s of a 65 s start
# on 2 cores; pip's and npm's settings name this machine's package indexes.
_USER_HOME = Path(os.path.expanduser("~"))
os.environ.setdefault("XDG_CACHE_HOME", str(_USER_HOME / ".cache"))
os.environ.setdefault("TRITON_CACHE_DIR", str(_USER_HOME / ".triton" / "cache"))
for _var, _path in (("PIP_CONFIG_FILE", _USER_HOME / ".config" / "pip" / "pip.conf"),
                    ("NPM_CONFIG_USERCONFIG", _USER_HOME / ".npmrc")):
    if _path.is_file():
        os.environ.setdefault(_var, str(_path))
for _var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):  # a client reads its config from these
    os.environ.pop(_var, None)
_RUN_DIR = Path(tempfile.mkdtemp(prefix="agentbox-tests-"))
atexit.register(shutil.rmtree, _RUN_DIR, ignore_errors=True)
os.environ["HOME"] = str(_RUN_DIR / "home")
os.environ["AGENTBOX_HOME"] = str(_RUN_DIR / "state")
(_RUN_DIR / "home").mkdir()
# `agentbox serve` keeps a disk KV tier by default and writes its cache there at every stop (up to
# disk_flush_s): dozens of servers a run would each pay it. The disk-tier tests pass --disk-cache-gb.
os.environ.setdefault("AGENTBOX_DISK_CACHE_GB", "0")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF file; skips the test when it is not installed."""
    path = embedded_model_path()
    if path is None:
        pytest.skip(f"SmolLM2 GGUF not installed: {INSTALL_HINT}")
    return path


@pytest.fixture
def exact_cpu_kernels():  # noqa: ANN201 - a generator fixture
    """Quantised layers loaded inside are dequantised to the compute dtype on CPU, so they match a
    dequantised twin exactly; the default CPU kernel rounds activations to int8 as llama.cpp does, and
    tests/test_cpu_gemv.py checks that path against its own twin and transformers."""
    from agentbox.layers.quant import int4

    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        yield


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_path: Path):  # noqa: ANN201 - LoadedModel, imported lazily
    """SmolLM2 loaded once per test run (fp32, CPU), shared by every in-process engine test. Its layers are
    dequantised (exact_cpu_kernels): the engine tests compare batched, chunked, cached and preempted runs
    token for token, and the default CPU path's int8-rounded activations make the last bits of a token
    depend on which path its step took (tests/test_cpu_gemv.py, test_cpu_decode.py cover that path)."""
    import torch

    from agentbox.layers.quant import int4
    from agentbox.models.loader import load_model

    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        return load_model(str(smollm2_path), torch.float32, "cpu")


@pytest.fixture(scope="session")
def smollm2_fast(smollm2_path: Path):  # noqa: ANN201 - LoadedModel, imported lazily
    """SmolLM2 on the default CPU path (4-bit layers and the Q8_0 head through kernels/cpu_gemv), once."""
    import torch

    from agentbox.models.loader import load_model

    return load_model(str(smollm2_path), torch.float32, "cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path):  # noqa: ANN201
    from agentbox.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(str(smollm2_path)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def agentbox_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agentbox-home")


@pytest.fixture(scope="session")
def live_server(smollm2_path: Path, agentbox_home: Path):  # noqa: ANN201 - yields the base URL
    """One real agentbox server per test run, started the way a user does (`agentbox serve`, background),
    on an ephemeral loopback port, stopped with `agentbox stop` at the end."""
    import os
    import subprocess
    import sys

    port = _free_port()
    env = {**os.environ, "AGENTBOX_HOME": str(agentbox_home)}
    cmd = [
        sys.executable,
        "-m",
        "agentbox.cli.main",
        "serve",
        "--model",
        str(smollm2_path),
        "--port",
        str(port),
        "--num-pages",
        str(8192 // CPU_PAGE_SIZE),
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "2048",
        "--record-trace",
        str(agentbox_home / "recorded.jsonl"),
        # The exact (dequantised) CPU path: tests here check what SmolLM2 answers. On the default path,
        # whose activations are rounded to int8 as llama.cpp's are, "What is the capital of France?"
        # starts "L'Étoile, la Marseillaise" -- token for token what llama.cpp answers on this file.
        "--exact-cpu",
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        log = agentbox_home / "server.log"
        raise RuntimeError(f"agentbox serve failed: {r.stderr}\n{log.read_text() if log.exists() else ''}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(
            [sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60
        )


@pytest.fixture
def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake HOME (what client setup writes into) and agentbox state dir, both under tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "state"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a `slow` test run first (order kept otherwise): the two workers (pyproject's addopts) take
    whole files, so a long file drawn last would run alone at the end while the other worker sits idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
