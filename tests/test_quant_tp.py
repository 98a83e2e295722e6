"""Quantised checkpoints at tensor-parallel size 2: two gloo ranks in this test, each loading only its
shard of an AWQ, a GPTQ, a compressed-tensors W4A16 (asym, act-order) and an FP8 checkpoint, against the
same checkpoints at tp 1."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_harness import PagedRunner
from quant_checkpoints import PROMPT, write_fp8, write_int4

from agentbox.layers.quant import int4
from agentbox.layers.weight_loading import load_weight
from agentbox.models.loader import load_model
from agentbox.parallel.state import set_tp_state

NAMES = ("awq", "gptq", "w4a16", "fp8")


def _logits(model: Path) -> torch.Tensor:
    # Dequantised on CPU: the sharding is under test, and int8-rounded activations would amplify the
    # all-reduce's summation order into rounding flips (tests/test_cpu_gemv.py covers that kernel).
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        return PagedRunner(load_model(str(model), torch.float32, "cpu")).step({0: PROMPT})[0]


def _rank(rank: int, root: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2)
    set_tp_state(rank, 2)
    try:
        for name in NAMES:
            torch.save(_logits(root / name), root / f"{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
        set_tp_state(0, 1)


def test_quantised_checkpoints_at_tp2_equal_tp1(tmp_path: Path) -> None:
    write_int4(tmp_path / "awq", "awq")
    write_int4(tmp_path / "gptq", "gptq", sym=True)
    write_int4(tmp_path / "w4a16", "compressed-tensors", act_order=True)
    write_fp8(tmp_path / "fp8")
    mp.spawn(_rank, args=(tmp_path,), nprocs=2, join=True)
    for name in NAMES:
        one = _logits(tmp_path / name)
        for rank in (0, 1):  # the head all-gathers the vocab: both ranks hold every logit
            torch.testing.assert_close(torch.load(tmp_path / f"{name}-rank{rank}.pt"), one, atol=1e-4, rtol=1e-4)


def test_a_rank_reads_only_its_shard_of_a_safetensors_slice(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from agentbox.layers.linear import ColumnParallelLinear, RowParallelLinear
    from agentbox.layers.quant.lazy import LazySlice

    w = torch.randn(8, 6)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        lazy = LazySlice.of(f.get_slice("w"))
        assert torch.equal(lazy.narrow(0, 2, 4).narrow(1, 1, 3).materialize(), w[2:6, 1:4])
        set_tp_state(1, 2)
        try:
            col, row = ColumnParallelLinear(6, 8), RowParallelLinear(6, 8)
            load_weight(col.weight, lazy)
            load_weight(row.weight, lazy)
        finally:
            set_tp_state(0, 1)
    assert torch.equal(col.weight.data, w[4:]) and torch.equal(row.weight.data, w[:, 3:])
