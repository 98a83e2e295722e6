"""Experts in the k-bit form (kernels/dequant.py: bits 5, 6, 8 with a scale, and optionally an offset, per
group of 16 or 32 inputs), as GGUF's Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K experts load (layers/experts/gguf.py).
They stay quantised in memory on every device: the fused kernel (kernels/fused_moe_quant.py
`fused_moe_bits`) decodes tiles in its K loop on CUDA; elsewhere the reference dequantises only the experts
a forward routes to, one at a time (as Int4Experts does).

w13 and w2 each have their own `BitsForm`: a Q4_K_M layer runs Q4_K gate/up (bits 4: the int4 form, no
high bits) with a Q6_K down (6 bits, groups of 16, symmetric). Per projection, K its input, N its output:
`{w}_qweight` int32 [E, K/8, N] (the low nibbles), `{w}_qhigh` int32 [E, K (bits-4)/32, N] (bits > 4),
`{w}_scale` [E, K/g, N] and `{w}_offset` [E, K/g, N] (absent when symmetric) in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentbox.layers.experts.base import ExpertLayer, ExpertMethod, expert_activation, fused_kernel, moe_ref


@dataclass(frozen=True)
class BitsForm:
    """How one projection of every expert is stored."""

    bits: int  # 4 (the int4 form), 5, 6 or 8; 2 or 3 (GGUF Q2_K / Q3_K, groups of 16): the int4 layout
    group: int  # inputs per scale: 16 or 32
    has_offset: bool  # w = q * scale + offset; else (q - 2^(bits-1)) * scale

    def __post_init__(self) -> None:
        narrow = self.bits in (2, 3) and self.group == 16
        if (self.bits not in (4, 5, 6, 8) and not narrow) or self.group not in (16, 32) or (
            self.bits <= 4 and not self.has_offset
        ):
            raise ValueError(f"k-bit experts: no form for {self}")

    @property
    def layout_bits(self) -> int:
        """The width the layout stores: codes below 4 bits sit in the int4 layout's nibbles (with an offset,
        so the kernels read them as 4-bit codes; only the CPU repack uses their real width)."""
        return max(self.bits, 4)

    @property
    def rows_per_word(self) -> int:
        """K rows each int32 word of the layout packs: inputs per rank must be a multiple of it."""
        return 8 if self.bits <= 4 else max(8, 32 // (self.bits - 4))


@dataclass(frozen=True)
class BitsCodes:
    """One projection of every expert before packing: codes [E, N, K] uint8 below 2^bits, scale and offset
    [E, N, K/group] fp32 (offset None: symmetric), with w[n, k] = q * scale + offset."""

    codes: torch.Tensor
    form: BitsForm
    scale: torch.Tensor
    offset: torch.Tensor | None


def pack_k(q: torch.Tensor, width: int = 4) -> torch.Tensor:
    """[E, N, K] values below 2^width (width 1, 2 or 4) -> [E, K width / 32, N] int32, 32 / width consecutive
    K rows per word, row k at bit width * (k % (32 / width)): `int4.pack_rows_int32` (width 4) and
    kernels/dequant.py `pack_bits`' high words, bit for bit. Done in bytes (8 / width codes a byte, four bytes
    a little-endian word) and one transpose of the words: on a Qwen3-30B layer (128 x 1536 x 2048) a per-row
    shift loop over int32 copies of the codes took 2 s and 1.6 GB per projection."""
    per = 8 // width
    if width not in (1, 2, 4) or q.shape[-1] % (32 // width):
        raise ValueError(f"packing {width}-bit rows needs the input dim ({q.shape[-1]}) to be a multiple of {32 // width}")
    packed = q[..., 0::per].clone()
    for i in range(1, per):
        packed |= q[..., i::per] << (width * i)
    return packed.contiguous().view(torch.int32).transpose(1, 2).contiguous()


class BitsExperts(ExpertMethod):
    """k-bit (and int4) experts, one `BitsForm` per projection. Only the GGUF loader fills them (`install`)."""

    def __init__(self, w13: BitsForm, w2: BitsForm) -> None:
        self.forms = {"w13": w13, "w2": w2}

    def create_weights(self, layer: ExpertLayer) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        dtype = torch.get_default_dtype()
        for w, (k, n) in (("w13", (h, layer.w13_rows)), ("w2", (i, h))):
            form = self.forms[w]
            if k % form.group or k % form.rows_per_word:
                raise ValueError(
                    f"{layer.prefix or 'FusedMoE'}: {w} takes {k} inputs per rank, not a multiple of its "
                    f"{form.bits}-bit form's {max(form.group, form.rows_per_word)}-row groups"
                )
            layer.add_expert_param(f"{w}_qweight", torch.empty(e, k // 8, n, dtype=torch.int32))
            if form.bits > 4:
                layer.add_expert_param(f"{w}_qhigh", torch.empty(e, k * (form.bits - 4) // 32, n, dtype=torch.int32))
            layer.add_expert_param(f"{w}_scale", torch.empty(e, k // form.group, n, dtype=dtype))
            if form.has_offset:
                layer.add_expert_param(f"{w}_offset", torch.empty(e, k // form.group, n, dtype=dtype))

    def install(self, layer: ExpertLayer, w: str, codes: BitsCodes) -> None:
        """Pack one projection's codes ([E, N, K], this rank's part) into the parameters create_weights made."""
        form = self.forms[w]
        if codes.form != form:
            raise ValueError(f"{layer.prefix or 'FusedMoE'}: {w} codes are {codes.form}, the layer holds {form}")
        q = codes.codes
        getattr(layer, f"{w}_qweight").data.copy_(pack_k(q & 0xF))
        if form.bits > 4:
            getattr(layer, f"{w}_qhigh").data.copy_(pack_k(q >> 4, form.bits - 4))
        getattr(layer, f"{w}_scale").data.copy_(codes.scale.transpose(1, 2))
        if codes.offset is not None:
            getattr(layer, f"{w}_offset").data.copy_(codes.offset.transpose(1, 2))

    @staticmethod
    def tensors(layer: ExpertLayer, w: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(qweight, qhigh, scale, offset) of projection `w`: the kernels' `BitsWeights` tensors."""
        return (
            getattr(layer, f"{w}_qweight"), getattr(layer, f"{w}_qhigh", None), getattr(layer, f"{w}_scale"),
            getattr(layer, f"{w}_offset", None),
        )

    def dequantized_expert(self, layer: ExpertLayer, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: expert e's (w13 [2I, H], w2 [H, I]) in `dtype`."""
        from agentbox.kernels.dequant import dequant_bits, dequant_int4  # plain torch: no kernel decorated

        out = []
        for w, form in self.forms.items():
            qweight, qhigh, scale, offset = (None if t is None else t[e] for t in self.tensors(layer, w))
            if qhigh is None:
                d = dequant_int4(qweight, scale, offset, form.group)  # type: ignore[arg-type]
            else:
                d = dequant_bits(qweight, qhigh, scale, offset, form.group, form.bits)  # type: ignore[arg-type]
            out.append(d.t().to(dtype))
        return out[0], out[1]

    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        if x.is_cuda and (kernel := fused_kernel("fused_moe_bits")) is not None:
            from agentbox.kernels.fused_moe_quant import BitsWeights  # fused_kernel imported it

            act = expert_activation(layer)
            w13, w2 = (BitsWeights(*self.tensors(layer, w), f.group, f.layout_bits) for w, f in self.forms.items())
            return kernel(x, w13, w2, topk_weights, topk_ids, act, b13, b2)
        return moe_ref(
            x, topk_weights, topk_ids, lambda e: self.dequantized_expert(layer, e, x.dtype), layer.activation,
            b13, b2, layer.swiglu_alpha, layer.swiglu_limit,
        )
