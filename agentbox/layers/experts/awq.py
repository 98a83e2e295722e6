"""AWQ experts: loaded in AutoAWQ's GEMM layout per expert, one stacked parameter per tensor name sharded by the
shared loader, converted once after loading into the canonical int4 expert form (layers/experts/int4.py)."""

from __future__ import annotations

import torch

from agentbox.layers.experts.base import ExpertLayer, add_sharded_param
from agentbox.layers.experts.int4 import Int4CheckpointExperts, pack_rows_bytes, raw_tensor
from agentbox.layers.quant.awq import awq_unpack
from agentbox.layers.quant.base import Sharding


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


class AwqExperts(Int4CheckpointExperts):
    """AutoAWQ GEMM layout per expert: qweight int32 [in, out / 8] and qzeros int32 [in / g, out / 8] in
    AWQ nibble order, scales fp16 [in / g, out] (layers/quant/awq.py)."""

    RAW = ("qweight", "qzeros", "scales")

    def createraw_tensor(self, layer: ExpertLayer) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.intermediate_local, self.group
        i32, f16 = torch.int32, torch.float16
        for w, k, n in (("w13", h, layer.w13_rows), ("w2", i, h)):
            add_sharded_param(layer, f"{w}_qweight", torch.empty(e, k, n // 8, dtype=i32), Sharding(1, 0, 8, 1))
            add_sharded_param(layer, f"{w}_qzeros", torch.empty(e, k // g, n // 8, dtype=i32), Sharding(1, 0, 8, g))
            add_sharded_param(layer, f"{w}_scales", torch.empty(e, k // g, n, dtype=f16), Sharding(1, 0, 1, g))

    def to_canonical(
        self, layer: ExpertLayer, w: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        qweight, qzeros, s = raw_tensor(layer, f"{w}_qweight"), raw_tensor(layer, f"{w}_qzeros"), raw_tensor(layer, f"{w}_scales").float()
        e, k, n = qweight.shape[0], qweight.shape[1], s.shape[2]
        z = awq_unpack(qzeros.reshape(-1, qzeros.shape[2])).reshape(e, -1, n).float()
        # [E*K, N/8]: K % 8 == 0, so packing along K never mixes experts
        return awq_to_rows(qweight.reshape(e * k, -1)).reshape(e, k // 8, n), s, -z * s, None
