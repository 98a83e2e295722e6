"""Which on-disk namespace a running engine may read: a hash of everything that decides what a KV page holds.

A page written by one model must never be served to another. The key covers the weights' identity (every
file of the model: its name, size and mtime, cheap to read for a 50 GB checkpoint; a file replaced in
place changes its mtime), the compute dtype, the KV dtype and layout (layers, heads, head size), the page
size, the tensor-parallel degree, the CPU path (the exact one and the int8 one compute different KV), and
the tokenizer and chat template (files of the model, or inside its GGUF). Anything else is another
namespace; the disk tier evicts other namespaces before its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import agentbox
from agentbox.config import EngineConfig
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache

# Bumped when the chunk format or what a page holds changes: old namespaces then stop matching.
FORMAT_VERSION = 3  # 2: CRC-32 checksums, state snapshots; 3: chunks carry their own headers (disk_index.py)


def _files(model: Path) -> list[tuple[str, int, int]]:
    if model.is_file():
        st = model.stat()
        return [(model.name, st.st_size, st.st_mtime_ns)]
    out = []
    for root, _, names in os.walk(model):
        for name in names:
            p = Path(root, name)
            try:
                st = p.stat()
            except OSError:
                continue
            out.append((str(p.relative_to(model)), st.st_size, st.st_mtime_ns))
    return sorted(out)


@dataclass(frozen=True)
class Namespace:
    key: str  # hex digest: the directory name
    meta: dict[str, object]  # what the key covers, written beside it for `agentbox cache`


def namespace_for(config: EngineConfig, kv: KVCache, tp: int = 1, state: StateCache | None = None) -> Namespace:
    """`state`: a model's per-sequence state (hybrid, Gemma 4): its snapshots' layout is part of the key."""
    model = Path(config.model).expanduser()
    t = kv.k[0]
    meta: dict[str, object] = {
        "format": FORMAT_VERSION,
        "agentbox": agentbox.__version__,
        "model": str(model),
        "files": _files(model) if model.exists() else [],
        "dtype": config.resolved_dtype,
        "kv_dtype": str(t.dtype),
        "kv_layout": [[s.num_kv_heads, s.head_dim, s.v_head_dim or s.head_dim, s.tied] for s in kv.specs],
        "page_size": kv.page_size,
        # only where a layer keeps compressed entries: the namespaces of other models stay what they were
        **({"tokens_per_entry": kv.tokens_per_entry} if any(t > 1 for t in kv.tokens_per_entry) else {}),
        "tp": tp,
        "exact_cpu": config.exact_cpu,
        "device": t.device.type,
    }
    if state is not None:  # only then: the namespaces of models without state stay what they were
        meta["state_layout"] = [[list(x.shape[1:]), str(x.dtype)] for layer in state.layers for x in layer]
    blob = json.dumps(meta, sort_keys=True).encode()
    return Namespace(hashlib.blake2b(blob, digest_size=12).hexdigest(), meta)
