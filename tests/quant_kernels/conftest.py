"""Dequant-GEMM kernel tests: on CUDA where there is one, else on CPU under Triton's interpreter (set here,
before any kernel module of this folder's tests is imported; nothing else in the suite imports them)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
