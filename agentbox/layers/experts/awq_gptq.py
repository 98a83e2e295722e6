"""AWQ and GPTQ experts: loaded in the checkpoint's own per-expert layout (AutoAWQ GEMM; GPTQ v1 sym,
asym, act-order), one stacked parameter per tensor name sharded by moe_quant's loader, and converted once
after loading into the canonical int4 expert form (`moe_quant.Int4Experts`) that every kernel reads.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from agentbox.layers.experts.base import FusedMoE
from agentbox.layers.experts.quant import (
    Int4Experts,
    add_sharded_param,
    check_dims,
    pack_rows_bytes,
    register_expert_method,
    unpack_rows_bytes,
)
from agentbox.layers.quant.awq import awq_unpack
from agentbox.layers.quant.base import QuantConfig, Sharding
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.gptq import unpack_cols_int32


def awq_to_rows(packed: torch.Tensor) -> torch.Tensor:
    """AWQ qweight [K, N / 8] (columns packed in AWQ nibble order) -> [K / 8, N] int32 packed along K
    (= pack_rows_int32(awq_unpack(packed))). The low nibbles of a word's four bytes hold columns 0, 4, 1,
    5 of its eight, the high nibbles 2, 6, 3, 7: each plane is packed along K as it lies, then the words
    (8x fewer than the codes) are put in column order."""
    k, w = packed.shape
    b = packed.contiguous().view(torch.uint8).reshape(k, w * 4)
    # plane p (low 0 / high 1), byte 2a + b of the word: column 4b + 2p + a
    planes = torch.stack([pack_rows_bytes(x).reshape(k // 8, w, 2, 2) for x in (b & 0xF, b >> 4)], dim=2)
    return planes.permute(0, 1, 4, 2, 3).reshape(k // 8, w * 8)


class _Int4CheckpointExperts(Int4Experts):
    """AWQ / GPTQ experts: loaded in the checkpoint's own per-expert layout (one stacked parameter per
    tensor name, sharded by the shared loader), converted into the canonical form once after loading."""

    RAW: tuple[str, ...] = ()

    def __init__(self, config: QuantConfig) -> None:
        if config.group_size <= 0:
            raise ValueError("quantization_config.group_size: MoE experts need a group size (per-channel -1 is not supported)")
        super().__init__(config.group_size)
        self.config = config

    def create_weights(self, layer: FusedMoE) -> None:
        check_dims(layer, self.group, f"{self.config.method.value} (group {self.group})")
        check_dims(layer, 8, f"{self.config.method.value} (8 per int32 word)")
        self.dtype = torch.get_default_dtype()
        layer.int4_group = self.group
        layer.w13_perm = layer.w2_perm = None
        self.create_raw(layer)

    @abstractmethod
    def create_raw(self, layer: FusedMoE) -> None:
        """Register the checkpoint layout's stacked parameters (RAW names) on `layer`."""

    @abstractmethod
    def to_canonical(
        self, layer: FusedMoE, w: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every expert's projection `w` (w13 / w2), on CPU, as (qweight [E, K/8, N], scale, offset
        [E, K/g, N] float32, perm [E, K] or None), all experts at once. A Qwen3-30B-shaped layer (128
        experts, 2048 x 768) converts in 3.9 s (AWQ) and 0.25 s (GPTQ) on this shared CPU, one thread;
        per expert with the word-shifting helpers AWQ took 6.4 s."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        device = getattr(layer, f"w13_{self.RAW[0]}").device
        out: dict[str, torch.Tensor] = {}
        for w in ("w13", "w2"):
            out[f"{w}_qweight"], scale, offset, perm = self.to_canonical(layer, w)
            out[f"{w}_scale"], out[f"{w}_offset"] = scale.to(self.dtype), offset.to(self.dtype)
            if perm is not None:
                setattr(layer, f"{w}_perm", nn.Parameter(perm.to(device), requires_grad=False))
            for name in self.RAW:
                delattr(layer, f"{w}_{name}")
        for name, t in out.items():
            layer.add_expert_param(name, t.to(device))


def _raw(layer: FusedMoE, name: str) -> torch.Tensor:
    return getattr(layer, name).data.cpu()


class AwqExperts(_Int4CheckpointExperts):
    """AutoAWQ GEMM layout per expert: qweight int32 [in, out / 8] and qzeros int32 [in / g, out / 8] in
    AWQ nibble order, scales fp16 [in / g, out] (layers/quant/awq.py)."""

    RAW = ("qweight", "qzeros", "scales")

    def create_raw(self, layer: FusedMoE) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.intermediate_local, self.group
        i32, f16 = torch.int32, torch.float16
        for w, k, n in (("w13", h, 2 * i), ("w2", i, h)):
            add_sharded_param(layer, f"{w}_qweight", torch.empty(e, k, n // 8, dtype=i32), Sharding(1, 0, 8, 1))
            add_sharded_param(layer, f"{w}_qzeros", torch.empty(e, k // g, n // 8, dtype=i32), Sharding(1, 0, 8, g))
            add_sharded_param(layer, f"{w}_scales", torch.empty(e, k // g, n, dtype=f16), Sharding(1, 0, 1, g))

    def to_canonical(
        self, layer: FusedMoE, w: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        qweight, qzeros, s = _raw(layer, f"{w}_qweight"), _raw(layer, f"{w}_qzeros"), _raw(layer, f"{w}_scales").float()
        e, k, n = qweight.shape[0], qweight.shape[1], s.shape[2]
        z = awq_unpack(qzeros.reshape(-1, qzeros.shape[2])).reshape(e, -1, n).float()
        # [E*K, N/8]: K % 8 == 0, so packing along K never mixes experts
        return awq_to_rows(qweight.reshape(e * k, -1)).reshape(e, k // 8, n), s, -z * s, None


class GptqExperts(_Int4CheckpointExperts):
    """GPTQ v1 layout per expert: qweight int32 [in / 8, out], qzeros int32 [groups, out / 8] (zero - 1),
    scales fp16 [groups, out], g_idx int32 [in] (layers/quant/gptq.py). With act-order (desc_act) the rows
    are sorted by group at conversion and the expert keeps its permutation (`w13_perm` / `w2_perm`); a
    down projection's TP shard must then still hold whole groups."""

    RAW = ("qweight", "qzeros", "scales", "g_idx")

    def create_raw(self, layer: FusedMoE) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.intermediate_local, self.group
        i32, f16 = torch.int32, torch.float16
        for w, k, n in (("w13", h, 2 * i), ("w2", i, h)):
            # With act-order a down shard's rows belong to groups anywhere in the table: keep it whole.
            whole = self.config.desc_act and w == "w2"
            groups, group_axis = (k * layer.tp_size // g, None) if whole else (k // g, 0)
            add_sharded_param(layer, f"{w}_qweight", torch.empty(e, k // 8, n, dtype=i32), Sharding(1, 0, 1, 8))
            add_sharded_param(layer, f"{w}_qzeros", torch.empty(e, groups, n // 8, dtype=i32), Sharding(1, group_axis, 8, g))
            add_sharded_param(layer, f"{w}_scales", torch.empty(e, groups, n, dtype=f16), Sharding(1, group_axis, 1, g))
            add_sharded_param(layer, f"{w}_g_idx", torch.empty(e, k, dtype=i32), Sharding(None, 0))

    def to_canonical(
        self, layer: FusedMoE, w: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        g = self.group
        qweight, qzeros, s = _raw(layer, f"{w}_qweight"), _raw(layer, f"{w}_qzeros"), _raw(layer, f"{w}_scales").float()
        g_idx = _raw(layer, f"{w}_g_idx").long()
        (e, k), n = g_idx.shape, s.shape[2]
        z = unpack_cols_int32(qzeros.reshape(-1, qzeros.shape[2])).reshape(e, -1, n).float() + 1
        if s.shape[1] * g == k and w == "w2":  # a sharded table: this rank's groups, numbered globally
            g_idx = g_idx - layer.tp_rank * (k // g)
        where = f"{layer.prefix or 'experts'}.{{}}.{'down' if w == 'w2' else 'gate/up'}_proj.g_idx"
        bad = ((g_idx < 0) | (g_idx >= s.shape[1])).any(dim=1)
        if bad.any():
            raise ValueError(f"{where.format(int(bad.nonzero()[0]))}: group index out of range [0, {s.shape[1]})")
        perm = torch.argsort(g_idx, dim=1, stable=True)
        rows = torch.gather(g_idx, 1, perm).reshape(e, k // g, g)
        split = (rows != rows[..., :1]).any(dim=2).any(dim=1)
        if split.any():
            raise ValueError(
                f"{where.format(int(split.nonzero()[0]))}: the rows of this tensor-parallel shard do not form "
                f"whole groups of {g} (act-order groups are spread over the ranks); run it at tensor-parallel size 1"
            )
        group_of = rows[..., 0, None].expand(-1, -1, n)  # [E, K/g, N]: the checkpoint group of each group
        scale, zero = torch.gather(s, 1, group_of), torch.gather(z, 1, group_of)
        if torch.equal(perm, torch.arange(k).expand(e, k)):
            return qweight, scale, -zero * scale, None
        q = unpack_rows_bytes(qweight.reshape(-1, n)).reshape(e, k, n)
        q = torch.gather(q, 1, perm[..., None].expand(-1, -1, n))
        return pack_rows_bytes(q.reshape(e * k, n)).reshape(e, k // 8, n), scale, -zero * scale, perm


register_expert_method(QuantMethod.AWQ, AwqExperts)
register_expert_method(QuantMethod.GPTQ, GptqExperts)
