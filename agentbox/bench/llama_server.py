"""llama.cpp's own `llama-server`: the CPU engine agentbox's numbers are compared with (DESIGN.md, "the CPU peer
to beat"), not llama-cpp-python's server, which decodes 3-4x slower than it on the same file.

Found, not bundled: `--llama-server PATH`, `$AGENTBOX_LLAMA_SERVER`, `llama-server` on PATH, or a copy `build()`
made. `build()` compiles it from the llama.cpp tree that the llama-cpp-python 0.3.36 sdist vendors (the tree whose
converter the GGUF tests run), native to this CPU (`-march=native`), into the user's cache: one `cmake` away, a few
minutes on two cores. Its multi-session settings name every result: `-np N` slots, and `-sps 0` (a request then
goes to the slot whose cached prompt it shares most; its default similarity threshold, 0.10, sends a session's
next turn to whichever slot is free and loses its history when sessions interleave).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.bench.spawn import Target

SDIST = "llama_cpp_python-0.3.36"
ENV_BINARY = "AGENTBOX_LLAMA_SERVER"
ENV_SDIST = "AGENTBOX_LLAMA_CPP_SDIST"  # a .tar.gz or an unpacked directory of the sdist: no download then
DEFAULT_SIMILARITY = 0.10  # llama-server's own `-sps` default
NOT_FOUND = (f"no llama-server: pass --llama-server PATH, set {ENV_BINARY}, put it on PATH, or build it here "
             "with `agentbox bench llamacpp --build-server` (needs cmake and a C++ compiler)")
# What the converter needs of the tree (the whole tree is unpacked only to build the server).
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")


def cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "agentbox" / "llama.cpp"


def built_binary(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / SDIST / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"


def find_binary(explicit: str | None = None) -> Path | None:
    """The llama-server to compare with: the one named, else $AGENTBOX_LLAMA_SERVER, else PATH's, else ours."""
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"--llama-server {explicit}: not an executable file")
        return path
    for candidate in (os.environ.get(ENV_BINARY), shutil.which("llama-server"), str(built_binary())):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def vendored_tree(cache: Path, converter_only: bool = False) -> Path | None:
    """The sdist's vendored llama.cpp directory, unpacked under `cache` (whole, or only what its converter
    reads); from $AGENTBOX_LLAMA_CPP_SDIST, a cached archive, or `pip download`. None without any of them."""
    given = os.environ.get(ENV_SDIST)
    archive = Path(given) if given else None
    if archive is not None and archive.is_dir():
        found = next(archive.rglob("convert_hf_to_gguf.py"), None)
        return found.parent if found else None
    tree = cache / SDIST / "vendor" / "llama.cpp"
    marker = "convert_hf_to_gguf.py" if converter_only else "CMakeLists.txt"
    if (tree / marker).is_file():
        return tree
    if archive is None:
        archive = cache / f"{SDIST}.tar.gz"
        if not archive.is_file():
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                   "llama-cpp-python==0.3.36", "-d", str(cache)], capture_output=True, timeout=600)
            if done.returncode or not archive.is_file():
                return None
    prefix = f"{SDIST}/vendor/llama.cpp/"
    wanted = tuple(prefix + part for part in CONVERTER_PARTS) if converter_only else (prefix,)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(cache, members=members, filter="data")
    return tree if (tree / marker).is_file() else None


def _without_amx() -> list[str]:
    """CMake flags that keep llama.cpp's AMX kernels out of a native build on a CPU with AMX: in this tree they stop
    on SIGILL at their first `tilezero` (its Q8_0 / Q4_K buffer type, on by default; seen on a 2-core KVM Xeon that
    grants the tile state, where agentbox's own tiles run), so llama-server could not load a Q8_0 or Q4_K_M file.
    `--no-repack` would avoid them too, but also turns off its x86 Q4_K repack."""
    from agentbox.kernels.cpu_gemv import cpu_flags

    if "amx_tile" not in cpu_flags():
        return []
    off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={off}", f"-DCMAKE_CXX_FLAGS={off}"]


def build(cache: Path | None = None, jobs: int | None = None) -> Path:
    """Compile llama-server from the vendored tree, native to this CPU; returns the binary. Errors name what is
    missing (cmake, a compiler, the sdist) and where the build's output went."""
    cache = cache or cache_root()
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake: `pip install cmake` or your package manager's")
    cache.mkdir(parents=True, exist_ok=True)
    tree = vendored_tree(cache)
    if tree is None:
        raise RuntimeError(f"the llama-cpp-python 0.3.36 sdist is not in {cache} and pip could not download it; "
                           f"set {ENV_SDIST} to a copy")
    log = cache / "build.log"
    steps = (
        ["cmake", "-S", str(tree), "-B", str(tree / "build"), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *_without_amx()],
        ["cmake", "--build", str(tree / "build"), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)],
    )
    with open(log, "w") as out:
        for cmd in steps:
            out.write(" ".join(cmd) + "\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"building llama-server failed; see {log}:\n{log.read_text()[-2000:]}")
    binary = tree / "build" / "bin" / "llama-server"
    if not binary.is_file():
        raise RuntimeError(f"the build finished without {binary}; see {log}")
    return binary



def convert_hf(hf_dir: Path, gguf_file: Path, outtype: str = "f16", tree: Path | None = None,
               no_mtp: bool = False, bpe_vocab: bool = False) -> Path:
    """llama.cpp's own converter (the vendored tree's) on the checkpoint `hf_dir`, `outtype` (f16, q8_0, ...),
    draft layers left out with `no_mtp` (the converter refuses the flag for an architecture without them).

    The checkpoints written here carry SmolLM2's tokenizer as agentbox re-derives it from the embedded GGUF;
    the converter identifies a BPE pre-tokenizer by a hash of how it splits a check text, and that copy splits
    runs of newlines and spaces differently from the hub's (229 against llama.cpp's 230 tokens on that text),
    so the converter is told it is "smollm" (what SmolLM2's own GGUF says). `bpe_vocab`: the converter writes
    that byte-level BPE vocabulary as it does for any GPT-2-style model, where its architecture's own vocabulary
    step expects another kind (Gemma 4's reads a SentencePiece-style byte-fallback tokenizer); the tensors and
    every other key are still the converter's."""
    tree = tree or vendored_tree(cache_root(), converter_only=True)
    if tree is None:
        raise FileNotFoundError("llama.cpp's converter is not here and pip could not download its sdist")
    code = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); from conversion import base; "
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'; ")
    if bpe_vocab:  # Gemma 4's is the only vocabulary step replaced so far (bench/arch_ggufs.py)
        code += "import conversion.gemma as g; g.Gemma4Model.set_vocab = base.TextModel._set_vocab_gpt2; "
    code += ("sys.argv = sys.argv[1:]; sys.argv[0] = sys.argv[0] + '/convert_hf_to_gguf.py'; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, str(tree), str(hf_dir), "--outfile", str(gguf_file),
                           "--outtype", outtype, *(["--no-mtp"] if no_mtp else [])], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama.cpp's converter failed on {hf_dir}: {done.stderr.strip().splitlines()[-1:]}")
    return gguf_file


# Added tokens llama.cpp's converter looks up by name in the tokenizer of an architecture (its special tokens):
# a checkpoint carrying SmolLM2's tokenizer gets them added (`converter_tokenizer`).
CONVERTER_TOKENS: dict[str, tuple[str, ...]] = {
    "Glm4MoeLiteForCausalLM": ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>"),
}


def converter_tokenizer(tokenizer: Any, architecture: str) -> Any:
    """`tokenizer`, or a copy with the added tokens the converter needs for `architecture` (CONVERTER_TOKENS)."""
    extra = [t for t in CONVERTER_TOKENS.get(architecture, ()) if t not in tokenizer.get_added_vocab()]
    if not extra:
        return tokenizer
    copy = deepcopy(tokenizer)
    copy.add_tokens(extra, special_tokens=True)
    return copy


@dataclass(frozen=True)
class Slots:
    """llama-server's multi-session settings: `-np count`, and `-sps similarity` (None: its default)."""

    count: int
    similarity: float | None = None

    @property
    def name(self) -> str:
        sps = "" if self.similarity is None else f" -sps {self.similarity:g}"
        return f"llama-server -np {self.count}{sps}"

    def args(self) -> list[str]:
        return ["-np", str(self.count), *([] if self.similarity is None else ["-sps", f"{self.similarity:g}"])]


def parse_similarities(spec: str) -> list[float | None]:
    """`0,default` (the CLI's form) as [0.0, None]."""
    out: list[float | None] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        try:
            out.append(None if part == "default" else float(part))
        except ValueError as e:
            raise ValueError(f"--llamacpp-sps wants numbers or 'default', comma separated; got {part!r}") from e
    return out


def target(binary: Path, gguf: str, ctx_per_slot: int, threads: int, slots: Slots) -> Target:
    """A llama-server on `gguf` to start on the placeholder port: each slot holds `ctx_per_slot` tokens."""
    cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-c", str(ctx_per_slot * slots.count),
           "-t", str(threads), "-tb", str(threads), *slots.args(), "--no-webui"]
    return Target(name=slots.name, command=cmd, ready_paths=("/health",),
                  meta={"engine": "llama-server", "slots": str(slots.count), "threads": str(threads),
                        "slot_prompt_similarity": "default" if slots.similarity is None else f"{slots.similarity:g}"})


def missing_target(slots: Slots) -> Target:
    return Target(name=slots.name, note=NOT_FOUND)


def build_info(binary: Path) -> dict[str, str]:
    """`llama-server --version`: its version and commit, and the compiler and target it was built with."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"binary": str(binary), "skipped": f"{type(exc).__name__}: {exc}"}
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return {"binary": str(binary), "version": " / ".join(lines[-2:])}
