"""`agentbox bench agreement` on one tiny model: the report's shape, and agreement that is computed (the exact path
against itself agrees everywhere, with no difference; a hand-made flip counts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentbox.bench.agreement import agreement_report, compare, save_tiny_arch

POSITIONS = 8


def _fp16(name: str, root: Path, tokenizer: Any) -> tuple[str, str]:
    """The fp16 checkpoint, without llama.cpp's converter (seconds, and no sdist needed)."""
    return str(save_tiny_arch(name, root / name, tokenizer)), "fp16 safetensors"


def test_report_structure_and_the_exact_path_agrees_with_itself(tmp_path: Path) -> None:
    report = agreement_report(["qwen3_moe"], POSITIONS, tmp_path, forms={"qwen3_moe": _fp16}, sides=(True, True))
    assert report["bench"] == "agreement" and report["cpu"]["cpu_model"] and report["torch_threads"] >= 1
    (row,) = report["archs"]
    assert row["arch"] == "qwen3_moe" and row["form"].startswith("fp16") and row["exact_cpu"] == [True, True]
    assert row["positions"] == POSITIONS and row["decided_positions"] == POSITIONS
    assert row["top1_agreement"] == 1.0 and row["max_abs_logit_diff"] == 0.0 and row["identical"]
    assert row["default"]["decode_tok_s"] > 0 and row["exact"]["decode_tok_s"] > 0


def test_a_flipped_position_counts() -> None:
    exact = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.9]])
    default = torch.tensor([[3.0, 1.0, 0.0], [0.0, 1.9, 2.0]])  # position 1's top two swapped, by 0.1
    got = compare(default, exact)
    assert got["top1_agreement"] == 0.5 and abs(got["max_abs_logit_diff"] - 0.1) < 1e-6
    assert got["decided_positions"] == 1 and got["flips_at_decided"] == 0  # a 0.1 margin moved by 0.1: a tie
