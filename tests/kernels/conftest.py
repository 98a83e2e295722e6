"""Kernel tests run on CUDA where there is one, else on CPU under Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, that is when its module is first imported; this
conftest is imported before the test modules of this folder, and nothing outside tests/kernels imports a
kernel module, so setting it here reaches every kernel. It is left unset on a CUDA machine.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
