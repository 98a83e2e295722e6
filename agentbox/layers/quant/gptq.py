"""GPTQ int4, the AutoGPTQ / GPTQModel layout of `*-GPTQ-Int4` releases (checkpoint format v1):

- `qweight` int32 [in / 8, out]: eight consecutive input rows per word, row k at bits 4 * (k % 8);
- `qzeros` int32 [groups, out / 8]: eight output columns per word in order, each stored as zero - 1
  (the v1 quirk: a symmetric checkpoint stores 7 for its implied zero of 8);
- `scales` fp16 [groups, out]; `g_idx` int32 [in]: the group of each input row (k // group, or a
  permutation of groups with act-order / desc_act);
- w[k, n] = (q[k, n] - (z[g_idx[k], n] + 1)) * s[g_idx[k], n].
config.json: quantization_config = {quant_method: gptq, bits: 4, group_size: 128, sym, desc_act}.

Act-order rows are sorted by group at load, so the groups become contiguous and the int4 kernels apply;
the activations are gathered through the same permutation.
"""

from __future__ import annotations

from typing import Any

import torch

from agentbox.layers.quant import int4
from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod


def unpack_cols_int32(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32, column c at bits 4 * (c % 8) -> [rows, cols] uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1).to(torch.uint8)


@register
class GPTQLinearMethod(LinearMethod):
    kind = QuantMethod.GPTQ

    checkpoint_names: tuple[str, ...] = ("qweight", "qzeros", "scales", "g_idx")  # dropped once repacked
    g_idx_name = "g_idx"

    def groups(self, layer: QuantLayer, input_size: int, output_size: int) -> tuple[int, bool]:
        """(groups in this rank's scale / zero tables, whether TP splits them along the input); sets
        self.group."""
        g = self.config.group_size if self.config.group_size > 0 else input_size
        if input_size % g or input_size % 8 or output_size % 8:
            raise ValueError(
                f"{self.kind.value}: a [{output_size}, {input_size}] shard does not fit group {g} / 8-row packing"
            )
        self.group = g
        self.g_idx_loaded = False
        # With act-order a row-parallel shard's rows belong to groups anywhere in the table: keep it whole.
        if self.config.desc_act and layer.tp_dim == 1:
            return input_size * layer.tp_size // g, False
        return input_size // g, not self.config.desc_act

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        groups, split = self.groups(layer, input_size, output_size)
        g, group_axis = self.group, 0 if split else None
        layer.qweight = quant_param(torch.empty(input_size // 8, output_size, dtype=torch.int32), Sharding(1, 0, 1, 8))
        layer.qzeros = quant_param(torch.empty(groups, output_size // 8, dtype=torch.int32), Sharding(1, group_axis, 8, g))
        layer.scales = quant_param(torch.empty(groups, output_size, dtype=torch.float16), Sharding(1, group_axis, 1, g))
        layer.g_idx = quant_param(torch.empty(input_size, dtype=torch.int32), Sharding(None, 0))

    def load(
        self, layer: QuantLayer, param: torch.nn.Parameter, loaded: Any, shard_id: str | int | None, name: str
    ) -> None:
        g_idx = getattr(layer, self.g_idx_name, None)
        if param is g_idx and shard_id is not None and self.g_idx_loaded:
            before = param.data.clone()
            super().load(layer, param, loaded, shard_id, name)
            if not torch.equal(before, param.data):  # fused shards read the same input: one order for all
                raise ValueError(f"{self.kind.value}: {name} has a g_idx different from its fused siblings'")
            return
        super().load(layer, param, loaded, shard_id, name)
        if param is g_idx:
            self.g_idx_loaded = True

    def g_idx(self, layer: QuantLayer) -> torch.Tensor:
        """The group of each of this rank's input rows, as a row of this rank's scale / zero tables."""
        g = layer.g_idx.data.long()
        rng = layer.in_range()
        if rng is not None and not self.config.desc_act:  # a row shard's tables hold only its own groups
            g = g - rng[0] // self.group
        return g

    def _rows(self, layer: QuantLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per input row k: codes [in, out], scale [in, out], zero [in, out] (the reference's terms)."""
        q = int4.unpack_rows_int32(layer.qweight.data)
        z = unpack_cols_int32(layer.qzeros.data).float() + 1
        g = self.g_idx(layer)
        return q, layer.scales.data.float()[g], z[g]

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        q, s, z = self._rows(layer)
        return ((q.float() - z) * s).t().contiguous()

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        g_idx = self.g_idx(layer)
        device = g_idx.device
        q, s, z = (t.cpu() for t in self._rows(layer))
        g_idx = g_idx.cpu()
        perm = torch.argsort(g_idx, stable=True)
        counts = torch.bincount(g_idx)
        contiguous = bool((counts[counts > 0] == self.group).all())
        kernel = self.config.kernel or int4.default_kernel(device)
        for name in self.checkpoint_names:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.act_perm = None
        if not contiguous:  # a shard holding parts of groups (act-order across TP ranks): dense
            kernel = int4.Int4Kernel.DENSE
        elif not torch.equal(perm, torch.arange(len(perm))):
            q, s, z = q[perm], s[perm], z[perm]
            layer.act_perm = quant_param(perm.to(device), Sharding(None, None))
        if not contiguous:
            w = ((q.float() - z) * s).t()
            layer.weight = quant_param(w.to(device=device, dtype=self.dtype).contiguous(), Sharding(None, None))
            layer.int4_kernel = kernel
            return
        rows = q.shape[0] // self.group
        scale = s.reshape(rows, self.group, -1)[:, 0].t().contiguous()  # [out, groups]
        offset = (-z * s).reshape(rows, self.group, -1)[:, 0].t().contiguous()
        int4.install(layer, q.t().contiguous(), scale, offset, kernel, self.dtype, device)

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.act_perm is not None:
            x = x.index_select(-1, layer.act_perm)
        return int4.apply(layer, x, bias)
