"""Load a tokenizer, converting a GGUF file's vocabulary once and keeping the result.

transformers rebuilds a tokenizer from GGUF metadata on every load (tens of seconds on a busy CPU);
the converted tokenizer saved next to our state loads in well under a second.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any


def _cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "agentbox" / "tokenizers"


def load_tokenizer(model: str | os.PathLike[str], *, cache_dir: Path | None = None) -> Any:
    """A transformers tokenizer for a model directory or a .gguf file."""
    from transformers import AutoTokenizer

    path = Path(model)
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(path))
    st = path.stat()
    tag = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = (cache_dir or _cache_root()) / f"{path.stem}-{tag}"
    if (target / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(target))
        except (OSError, ValueError):
            pass  # a damaged cache entry: rebuild it below
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, target)  # atomic: concurrent loaders never see half a directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is as good
    return tok
