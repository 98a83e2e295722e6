"""compressed-tensors W4A16 `pack-quantized` (llm-compressor's `*-quantized.w4a16` releases), dense linears:

- `weight_packed` int32 [out, in / 8]: eight consecutive input columns per word, column c at bits
  4 * (c % 8), each code stored as its signed value + 8 (so 0..15);
- `weight_scale` [out, in / group] in the model's dtype (bf16 in Qwen3 / Llama releases);
- `weight_zero_point` int32 [out / 8, in / group] (asymmetric only): eight consecutive output rows per
  word, packed and offset like the codes; symmetric checkpoints store none (zero 8 implied);
- `weight_g_idx` int32 [in] (actorder "group" only): the group of each input column;
- `weight_shape` [2] = (out, in) of the unpacked weight;
- w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)].
config.json: quantization_config = {quant_method: compressed-tensors, format: pack-quantized,
config_groups: {group_0: {targets: [Linear], weights: {num_bits: 4, type: int, symmetric, strategy: group,
group_size: 128, actorder}}}, ignore: [lm_head]}.

That is GPTQ's arithmetic with the codes transposed and no v1 zero quirk, so this is GPTQ's method reading
other tensors: same group tables under TP, same act-order sort, same canonical int4 form and kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from agentbox.layers.quant import int4
from agentbox.layers.quant.base import QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.gptq import GPTQLinearMethod, unpack_cols_int32


@register
class CompressedTensorsW4A16Method(GPTQLinearMethod):
    kind = QuantMethod.COMPRESSED_TENSORS
    checkpoint_names = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
    g_idx_name = "weight_g_idx"

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        groups, split = self.groups(layer, input_size, output_size)
        g, group_axis = self.group, 1 if split else None
        packed = torch.empty(output_size, input_size // 8, dtype=torch.int32)
        layer.weight_packed = quant_param(packed, Sharding(0, 1, 1, 8))
        # fp32 holds a bf16 or fp16 scale exactly; the canonical form takes the compute dtype afterwards
        layer.weight_scale = quant_param(torch.empty(output_size, groups), Sharding(0, group_axis, 1, g))
        if not self.config.sym:
            zp = torch.empty(output_size // 8, groups, dtype=torch.int32)
            layer.weight_zero_point = quant_param(zp, Sharding(0, group_axis, 8, g))
        if self.config.desc_act:
            layer.weight_g_idx = quant_param(torch.empty(input_size, dtype=torch.int32), Sharding(None, 0))
        layer.weight_shape = quant_param(torch.empty(2, dtype=torch.int64), Sharding(None, None))

    def load(
        self, layer: QuantLayer, param: torch.nn.Parameter, loaded: Any, shard_id: str | int | None, name: str
    ) -> None:
        if param is getattr(layer, "weight_shape", None):
            # (out, in) of the whole checkpoint tensor: its input width must be this layer's (all ranks).
            full_in = layer.input_size * (layer.tp_size if layer.tp_dim == 1 else 1)
            if int(loaded[1]) != full_in:
                raise ValueError(
                    f"compressed-tensors: {name} says {int(loaded[1])} input columns, the layer has {full_in}"
                )
            return
        super().load(layer, param, loaded, shard_id, name)

    def g_idx(self, layer: QuantLayer) -> torch.Tensor:
        if self.config.desc_act:
            return layer.weight_g_idx.data.long()
        return torch.arange(layer.input_size, device=layer.weight_packed.device) // self.group

    def _rows(self, layer: QuantLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = unpack_cols_int32(layer.weight_packed.data).t()  # [in, out]
        s = layer.weight_scale.data.float().t()  # [groups, out]
        if self.config.sym:
            z = torch.full_like(s, 8.0)
        else:
            z = int4.unpack_rows_int32(layer.weight_zero_point.data).float().t()
        g = self.g_idx(layer)
        return q, s[g], z[g]

