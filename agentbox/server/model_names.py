"""The names the served model answers to: the main one (`--served-model-name`, else from the path) that
responses and `/v1/models` carry, and aliases a user meets elsewhere — the `PROFILE:VARIANT` the CLI prints
(the serve chain, `agentbox models`), the profile name, the file name, `agentbox` (what `agentbox setup` writes
into clients: config.STABLE_MODEL_ALIAS) and `default`."""

from __future__ import annotations

import logging
from pathlib import Path

from agentbox.config import STABLE_MODEL_ALIAS, ServerConfig

log = logging.getLogger("agentbox.server")
DEFAULT_ALIAS = "default"


def served_name(config: ServerConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    p = Path(config.engine.model)
    name = p.stem if p.suffix == ".gguf" else p.name
    return name or "model"


def _profile_names(model: Path) -> list[str]:
    """`PROFILE:VARIANT` and `PROFILE` of the local model at this path (file or directory), if it is one."""
    from agentbox.hub.pull import list_local

    try:
        local = list_local()
    except Exception:  # aliases are a convenience: a broken models dir must not stop serving
        log.warning("could not list local models; the model answers only to its own names", exc_info=True)
        return []
    target = model.resolve()
    for m in local:
        found = Path(m.path).resolve()
        if target == found or found in target.parents or (found.is_file() and found.parent == target):
            return [f"{m.model}:{m.variant}", m.model]
    return []


def model_names(config: ServerConfig, engine_name: str) -> tuple[str, ...]:
    """Every name the model answers to, the main one first, without repeats."""
    path = Path(config.engine.model)
    names = [served_name(config), *_profile_names(path), path.name, engine_name, STABLE_MODEL_ALIAS, DEFAULT_ALIAS]
    if path.suffix == ".gguf":
        names.insert(len(names) - 2, path.stem)
    return tuple(dict.fromkeys(n for n in names if n))
