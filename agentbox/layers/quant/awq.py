"""AWQ int4, AutoAWQ's GEMM layout (what `*-AWQ` releases hold):

- `qweight` int32 [in, out / 8]: eight output columns per word, in AWQ's nibble order (the word's nibble i
  holds column AWQ_ORDER[i] of its eight);
- `qzeros` int32 [in / group, out / 8], packed the same way; `scales` fp16 [in / group, out];
- w[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n].
config.json: quantization_config = {quant_method: awq, bits: 4, group_size: 128, zero_point: true,
version: gemm}.
"""

from __future__ import annotations

import torch

from agentbox.layers.quant import int4
from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes -> [rows, cols / 8] int32 in AWQ order (the test's quantiser uses it)."""
    r, c = q.shape
    q = q.to(torch.int32).reshape(r, c // 8, 8)
    out = torch.zeros(r, c // 8, dtype=torch.int32)
    for i, col in enumerate(AWQ_ORDER):
        out |= q[..., col] << (4 * i)
    return out


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    r, w = packed.shape
    cols = [(packed >> (4 * i)) & 0xF for i in range(8)]  # nibble i
    out = torch.empty(r, w, 8, dtype=torch.uint8, device=packed.device)
    for i, col in enumerate(AWQ_ORDER):
        out[..., col] = cols[i].to(torch.uint8)
    return out.reshape(r, w * 8)


@register
class AWQLinearMethod(LinearMethod):
    kind = QuantMethod.AWQ

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        g = self.config.group_size
        if input_size % g or output_size % 8:
            raise ValueError(f"AWQ: a [{output_size}, {input_size}] shard does not fit group {g} / 8-column packing")
        self.dtype = dtype
        layer.qweight = quant_param(torch.empty(input_size, output_size // 8, dtype=torch.int32), Sharding(1, 0, 8, 1))
        layer.qzeros = quant_param(torch.empty(input_size // g, output_size // 8, dtype=torch.int32), Sharding(1, 0, 8, g))
        layer.scales = quant_param(torch.empty(input_size // g, output_size, dtype=torch.float16), Sharding(1, 0, 1, g))

    def int4_groups(self, layer: QuantLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = awq_unpack(layer.qweight.data).t()  # [out, in]
        z = awq_unpack(layer.qzeros.data).t().float()
        s = layer.scales.data.t().float()
        return q.contiguous(), s.contiguous(), (-z * s).contiguous()

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        return int4.dequantize(*self.int4_groups(layer))

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        device = layer.qweight.device
        q, s, o = (t.cpu() for t in self.int4_groups(layer))
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)
        int4.install(layer, q, s, o, self.config.kernel or int4.default_kernel(device), self.dtype, device)

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4.apply(layer, x, bias)
