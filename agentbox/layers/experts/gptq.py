"""GPTQ experts (v1: sym, asym, act-order): loaded in the checkpoint's layout per expert, one stacked parameter per
tensor name sharded by the shared loader, converted once after loading into the canonical int4 expert form
(layers/experts/int4.py)."""

from __future__ import annotations

import torch

from agentbox.layers.experts.base import ExpertLayer, add_sharded_param
from agentbox.layers.experts.int4 import Int4CheckpointExperts, pack_rows_bytes, raw_tensor, unpack_rows_bytes
from agentbox.layers.quant.base import Sharding
from agentbox.layers.quant.gptq import unpack_cols_int32


class GptqExperts(Int4CheckpointExperts):
    """GPTQ v1 layout per expert: qweight int32 [in / 8, out], qzeros int32 [groups, out / 8] (zero - 1),
    scales fp16 [groups, out], g_idx int32 [in] (layers/quant/gptq.py). With act-order (desc_act) the rows
    are sorted by group at conversion and the expert keeps its permutation (`w13_perm` / `w2_perm`); a
    down projection's TP shard must then still hold whole groups."""

    RAW = ("qweight", "qzeros", "scales", "g_idx")

    def createraw_tensor(self, layer: ExpertLayer) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.intermediate_local, self.group
        i32, f16 = torch.int32, torch.float16
        for w, k, n in (("w13", h, layer.w13_rows), ("w2", i, h)):
            # With act-order a down shard's rows belong to groups anywhere in the table: keep it whole.
            whole = self.config.desc_act and w == "w2"
            groups, group_axis = (k * layer.tp_size // g, None) if whole else (k // g, 0)
            add_sharded_param(layer, f"{w}_qweight", torch.empty(e, k // 8, n, dtype=i32), Sharding(1, 0, 1, 8))
            add_sharded_param(layer, f"{w}_qzeros", torch.empty(e, groups, n // 8, dtype=i32), Sharding(1, group_axis, 8, g))
            add_sharded_param(layer, f"{w}_scales", torch.empty(e, groups, n, dtype=f16), Sharding(1, group_axis, 1, g))
            add_sharded_param(layer, f"{w}_g_idx", torch.empty(e, k, dtype=i32), Sharding(None, 0))

    def to_canonical(
        self, layer: ExpertLayer, w: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        g = self.group
        qweight, qzeros, s = raw_tensor(layer, f"{w}_qweight"), raw_tensor(layer, f"{w}_qzeros"), raw_tensor(layer, f"{w}_scales").float()
        g_idx = raw_tensor(layer, f"{w}_g_idx").long()
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
