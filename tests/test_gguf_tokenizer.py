"""A GGUF's tokenizer where transformers has no config mapping for the file's architecture (`deepseek2`: the
GLM-4.7-Flash and other MLA files llama.cpp's converter writes): the vocabulary still converts by its own kind, so
`agentbox serve` starts on such a file (it failed at startup before)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentbox.models import loader


class _RefusesTheArchitecture:
    @staticmethod
    def from_pretrained(*args: object, **kwargs: object) -> None:
        raise ValueError("GGUF model with architecture deepseek2 is not supported yet.")


def test_the_vocabulary_converts_without_the_architecture(smollm2_path: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))  # an empty tokenizer cache: the file is converted
    monkeypatch.setattr(loader, "AutoTokenizer", _RefusesTheArchitecture)
    got = loader.load_tokenizer(loader.resolve_model(str(smollm2_path)))
    expected = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    text = "def f(x):\n    return x  # 'ok'\n\n\n"
    assert got.encode(text) == expected.encode(text) and got.chat_template == expected.chat_template
