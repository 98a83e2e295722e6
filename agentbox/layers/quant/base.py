"""The linear-method interface and its registry.

A linear layer (`layers/linear.py`) owns no weight layout of its own: its method creates the parameters,
loads checkpoint tensors into them (this rank's TP shard), post-processes them once after loading
(repacking for a kernel), and applies the matmul. The checkpoint chooses the method (`QuantConfig.of`),
the loader makes it current while the model is built (`quant_context`), and each layer asks for it.

TP shards are computed once, by the layer, in logical coordinates of the [out, in] weight; every parameter
says which of its axes carry the output and input dims and how many logical elements one stored element
covers there (`Sharding`: 8 for int4 packed into int32, 128 for a per-group scale), so one generic loader
narrows every layout. A shard that does not fall on a pack or group boundary is refused.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from agentbox.layers.quant.formats import NvFp4Layout, QuantMethod
from agentbox.layers.quant.lazy import materialize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint says about its quantisation (config.json's `quantization_config`, or GGUF)."""

    method: QuantMethod = QuantMethod.UNQUANTIZED
    bits: int = 16
    group_size: int = -1  # -1: one group per row (per-channel)
    sym: bool = True  # GPTQ: symmetric (zero point 8 implied; qzeros still stored)
    desc_act: bool = False  # GPTQ act-order: g_idx permutes the groups
    block_size: tuple[int, int] = (128, 128)  # FP8: [out, in] elements per weight_scale_inv entry
    # modules_to_not_convert / ignore / exclude_modules: a substring of the module name, an fnmatch pattern
    # (ModelOpt's `*.mlp.gate`) or compressed-tensors' `re:<regex>`
    skip_modules: tuple[str, ...] = field(default_factory=tuple)
    nvfp4_layout: NvFp4Layout = NvFp4Layout.MODELOPT  # NVFP4: which tensor names the checkpoint uses
    input_scales: bool = False  # NVFP4: the checkpoint stores activation global scales (W4A4 as made)
    kernel: Any = None  # an int4.Int4Kernel to force (benchmarks); None: the device's default
    # Linears the checkpoint's tensors leave unquantised, by our module name (the loader reads it off the files:
    # models/checkpoint_scan.py), beside the config's skip_modules
    unquantised: frozenset[str] = frozenset()
    experts: QuantMethod | None = None  # the MoE experts' format where it differs from `method`

    @staticmethod
    def of(hf_config: Any, hf_quant_config: dict[str, Any] | None = None) -> QuantConfig:
        """The checkpoint's method. Unknown methods are refused by name rather than run unquantised.
        `hf_quant_config`: ModelOpt's hf_quant_config.json, read where config.json carries no
        quantization_config (older ModelOpt exports keep it only there)."""
        raw = getattr(hf_config, "quantization_config", None)
        if raw is None and hf_quant_config is not None:
            return _modelopt({**hf_quant_config.get("quantization", hf_quant_config), "quant_method": "modelopt"})
        if raw is None:
            return QuantConfig()
        q = raw if isinstance(raw, dict) else raw.to_dict()
        name = str(q.get("quant_method", "")).lower()
        if name == "modelopt":
            return _modelopt(q)
        skip = tuple(q.get("modules_to_not_convert") or ())
        if name == "fp8":
            return _fp8(q, getattr(hf_config, "expert_dtype", None), skip)
        if name in ("awq", "gptq"):
            bits = int(q.get("bits", q.get("w_bit", 4)))
            if bits != 4:
                raise ValueError(f"quantization_config.bits: {name} with {bits} bits is not supported (4 only)")
            group = int(q.get("group_size", q.get("q_group_size", 128)))
            if name == "awq":
                version = str(q.get("version", "gemm")).lower()
                if version != "gemm":
                    raise ValueError(f"quantization_config.version: AWQ {version!r} is not supported (gemm only)")
                return QuantConfig(QuantMethod.AWQ, 4, group, sym=False, skip_modules=skip)
            fmt = str(q.get("checkpoint_format", "gptq")).lower()
            if fmt != "gptq":  # gptq_v2 stores zeros without v1's "- 1": read as v1 every weight would shift
                raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported (gptq v1 only)")
            return QuantConfig(
                QuantMethod.GPTQ, 4, group, sym=bool(q.get("sym", True)), desc_act=bool(q.get("desc_act", False)),
                skip_modules=skip,
            )
        if name == "compressed-tensors":
            return _compressed_tensors(q)
        if name == "gguf":
            return QuantConfig(QuantMethod.GGUF)
        if name == "mxfp4":
            # gpt-oss: only the experts are MXFP4 and the MoE layer reads them as stored (layers/experts/mxfp4.py);
            # its attention and router linears are unquantised.
            return QuantConfig(skip_modules=skip)
        raise ValueError(
            f"quantization_config.quant_method {name!r} is not supported "
            "(fp8, awq, gptq, compressed-tensors, gguf, mxfp4, modelopt)"
        )


# DeepSeek-V4's `expert_dtype` (transformers' FP8 config; V4 has it beside quantization_config, V4.1 inside):
# "fp4" is e2m1 packed two a byte with an E8M0 exponent per 32 values, i.e. MXFP4.
EXPERT_DTYPES = {"fp8": None, "fp4": QuantMethod.MXFP4}


def _fp8(q: dict[str, Any], expert_dtype: Any, skip: tuple[str, ...]) -> QuantConfig:
    """Block FP8 (Qwen3-*-FP8, DeepSeek-V3; DeepSeek-V4's release with `scale_fmt: ue8m0` and FP4 experts)."""
    what = "quantization_config"
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"{what}.weight_block_size: FP8 needs a [out, in] block size")
    if str(q.get("fmt") or "e4m3").lower() != "e4m3":
        raise ValueError(f"{what}.fmt {q.get('fmt')!r} is not supported (e4m3 only)")
    if str(q.get("scale_fmt") or "float").lower() not in ("float", "ue8m0"):  # ue8m0: scales stored as E8M0 bytes
        raise ValueError(f"{what}.scale_fmt {q.get('scale_fmt')!r} is not supported (float or ue8m0)")
    experts_dtype = str(q.get("expert_dtype") or expert_dtype or "fp8").lower()
    if experts_dtype not in EXPERT_DTYPES:
        raise ValueError(f"{what}.expert_dtype {experts_dtype!r} is not supported (fp8 or fp4)")
    return QuantConfig(QuantMethod.FP8_BLOCK, 8, block_size=(int(block[0]), int(block[1])), skip_modules=skip,
                       experts=EXPERT_DTYPES[experts_dtype])


NVFP4_GROUP = 16  # values per e4m3 block scale: the format's, every release's


def _modelopt(q: dict[str, Any]) -> QuantConfig:
    """NVIDIA ModelOpt's export: quant_algo NVFP4 (the FP8 and mixed algorithms are refused by name)."""
    what = "quantization_config"
    algo = str(q.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise ValueError(f"{what}.quant_algo {q.get('quant_algo')!r} is not supported (ModelOpt NVFP4 only)")
    group = int(q.get("group_size", NVFP4_GROUP))
    if group != NVFP4_GROUP:
        raise ValueError(f"{what}.group_size {group} is not supported (NVFP4 scales every {NVFP4_GROUP} values)")
    kv = q.get("kv_cache_quant_algo")
    if kv not in (None, "none", "None", "FP8"):
        raise ValueError(f"{what}.kv_cache_quant_algo {kv!r} is not supported (none, or FP8: its scales are not used)")
    skip = tuple(q.get("exclude_modules") or q.get("ignore") or ())
    return QuantConfig(QuantMethod.NVFP4, 4, NVFP4_GROUP, skip_modules=skip, input_scales=True)


def _nvfp4_scheme(scheme: dict[str, Any] | None, at: str) -> None:
    if (
        not scheme or int(scheme.get("num_bits", 0)) != 4 or scheme.get("type") != "float"
        or scheme.get("strategy") != "tensor_group" or scheme.get("group_size") != NVFP4_GROUP
    ):
        raise ValueError(f"{at}: {scheme!r} is not NVFP4 (4-bit float, tensor_group, group_size {NVFP4_GROUP})")


def _compressed_tensors_nvfp4(q: dict[str, Any]) -> QuantConfig:
    """compressed-tensors `nvfp4-pack-quantized` (llm-compressor's NVFP4 and NVFP4A16 schemes): every group
    must be NVFP4 weights; activations NVFP4 too (W4A4, `input_global_scale` stored) or none (A16)."""
    what = "quantization_config"
    inputs = set()
    for key, group in (q.get("config_groups") or {}).items():
        at = f"{what}.config_groups.{key}"
        if (group.get("format") or q.get("format")) != "nvfp4-pack-quantized":
            raise ValueError(f"{at}.format: NVFP4 groups mixed with {group.get('format')!r} are not supported")
        _nvfp4_scheme(group.get("weights"), f"{at}.weights")
        if group.get("input_activations") is not None:
            _nvfp4_scheme(group["input_activations"], f"{at}.input_activations")
        inputs.add(group.get("input_activations") is not None)
    if len(inputs) != 1:
        raise ValueError(f"{what}.config_groups: NVFP4 needs at least one group, all with or all without activations")
    return QuantConfig(
        QuantMethod.NVFP4, 4, NVFP4_GROUP, skip_modules=tuple(q.get("ignore") or ()),
        nvfp4_layout=NvFp4Layout.COMPRESSED_TENSORS, input_scales=inputs.pop(),
    )


def _compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    """llm-compressor's config: W4A16 `pack-quantized` over every Linear, the LM head left out. Other schemes
    (W8A8, FP8, NVFP4, sparsity, per-module targets) are refused by the field that says so."""
    what = "quantization_config"
    if q.get("format") == "nvfp4-pack-quantized":
        return _compressed_tensors_nvfp4(q)
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{what}.config_groups: compressed-tensors needs at least one config group")
    sparsity = q.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"{what}.sparsity_config.format {sparsity.get('format')!r} is not supported (dense only)")
    ignored = [m for m in q.get("ignore") or () if not str(m).endswith("lm_head")]
    if ignored:  # our LM head is never quantised; other unquantised modules would need per-module methods
        raise ValueError(f"{what}.ignore: only lm_head may be left unquantised, not {ignored}")
    weights: list[dict[str, Any]] = []
    for key, group in groups.items():
        at = f"{what}.config_groups.{key}"
        fmt = group.get("format") or q.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"{at}.format {fmt!r} is not supported (pack-quantized only)")
        if list(group.get("targets") or ()) != ["Linear"]:
            raise ValueError(f"{at}.targets {group.get('targets')!r} is not supported ([Linear] only)")
        if group.get("input_activations") is not None:
            raise ValueError(f"{at}.input_activations: activation quantisation is not supported (W4A16 only)")
        w = group.get("weights") or {}
        if int(w.get("num_bits", 0)) != 4 or w.get("type", "int") != "int":
            raise ValueError(f"{at}.weights: {w.get('num_bits')}-bit {w.get('type')} is not supported (4-bit int)")
        if w.get("strategy") != "group" or not isinstance(w.get("group_size"), int) or w["group_size"] <= 0:
            raise ValueError(f"{at}.weights.strategy {w.get('strategy')!r} is not supported (group, with a group_size)")
        if w.get("actorder") not in (None, False, True, "group", "dynamic", "weight", "static"):
            raise ValueError(f"{at}.weights.actorder {w.get('actorder')!r} is not supported")
        weights.append(w)
    if any(w != weights[0] for w in weights):
        raise ValueError(f"{what}.config_groups: groups with different weight schemes are not supported")
    w = weights[0]
    # actorder "group" stores weight_g_idx (groups permuted); "weight" only reordered the solve: groups stay in order.
    return QuantConfig(
        QuantMethod.COMPRESSED_TENSORS, 4, int(w["group_size"]), sym=bool(w.get("symmetric", True)),
        desc_act=w.get("actorder") in (True, "group", "dynamic"),
    )


@dataclass(frozen=True)
class Sharding:
    """Where a parameter keeps the logical output / input dims (None: it has no such axis, replicated)."""

    out_axis: int | None
    in_axis: int | None
    out_pack: int = 1  # logical output elements per stored element along out_axis
    in_pack: int = 1  # logical input elements per stored element along in_axis


def quant_param(data: torch.Tensor, sharding: Sharding) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.sharding = sharding  # type: ignore[attr-defined]
    return p


class QuantLayer(nn.Module):
    """A linear layer as its method sees it (layers/linear.py QuantLayer is the one there is): this rank's sizes,
    how tensor parallelism splits it, and where one checkpoint tensor's shard lands (`out_range`, `in_range`, in
    logical [out, in] coordinates). Declared here, apart from the layer, so the methods need not import it."""

    prefix: str  # the module's name in the model (what errors and the unquantised set name)
    tp_dim: int | None  # 0: output rows split over the ranks, 1: input columns, None: replicated
    tp_rank: int
    tp_size: int
    input_size: int  # this rank's
    output_size: int  # this rank's
    quant_method: LinearMethod
    bias: nn.Parameter | None

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
        """(offset in this layer's output rows, offset in the checkpoint tensor's rows, row count)."""
        return 0, 0, self.output_size

    def in_range(self) -> tuple[int, int] | None:
        """(start, size) of this rank's input columns in the checkpoint tensor; None: all of them."""
        return None


def narrow_shard(t: torch.Tensor, axis: int, start: int, size: int, pack: int, what: str) -> torch.Tensor:
    # A shard must start on a pack/group boundary; its end may cut a partial last block (FP8 scales of a
    # dim that is not a multiple of 128 cover it with one more row), which the shape check then judges.
    if start % pack:
        raise ValueError(
            f"{what}: tensor-parallel shard [{start}, {start + size}) does not fall on a {pack}-element "
            f"boundary of the quantised layout"
        )
    return t.narrow(axis, start // pack, min(-(-size // pack), t.shape[axis] - start // pack))


class LinearMethod(ABC):
    """One way of holding and applying a linear layer's weight."""

    kind: ClassVar[QuantMethod]

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    @abstractmethod
    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        """Register this rank's parameters on `layer` (each `quant_param` with its Sharding)."""

    def load(
        self, layer: QuantLayer, param: nn.Parameter, loaded: Any, shard_id: str | int | None, name: str
    ) -> None:
        """Copy this rank's shard of a checkpoint tensor into `param` (narrowed along its Sharding)."""
        sh: Sharding = param.sharding  # type: ignore[attr-defined]
        dst, src = param.data, loaded
        dst_off, src_off, size = layer.out_range(shard_id)
        if sh.out_axis is not None:
            dst = narrow_shard(dst, sh.out_axis, dst_off, size, sh.out_pack, name)
            src = narrow_shard(src, sh.out_axis, src_off, size, sh.out_pack, name)
        rng = layer.in_range()
        if rng is not None and sh.in_axis is not None:
            src = narrow_shard(src, sh.in_axis, rng[0], rng[1], sh.in_pack, name)
        if dst.shape != src.shape:
            raise ValueError(f"{type(layer).__name__}: {name} shard shape {tuple(src.shape)} != {tuple(dst.shape)}")
        dst.copy_(materialize(src))  # a LazySlice is read here: only this rank's part

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        """Once, after every shard is in: repack for the kernel this device runs."""
        return None

    @abstractmethod
    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] for this rank."""

    @abstractmethod
    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        """This rank's loaded weight as a dense [out, in] fp32 tensor (the method's torch reference; read
        before post-processing, which may repack it)."""

    def row_runs(self, layer: QuantLayer) -> list[nn.Module]:
        """The modules holding the layer's output rows, in order, each in one form (layers/quant/cpu_parts.py reads
        them): the layer itself, unless the method keeps runs of rows in different forms."""
        return [layer]


_REGISTRY: dict[QuantMethod, type[LinearMethod]] = {}


def register(cls: type[LinearMethod]) -> type[LinearMethod]:
    _REGISTRY[cls.kind] = cls
    return cls


def registered() -> dict[QuantMethod, type[LinearMethod]]:
    return dict(_REGISTRY)


_current = QuantConfig()


@contextlib.contextmanager
def quant_context(config: QuantConfig) -> Iterator[None]:
    """Layers built inside take their method from `config` (the loader wraps model construction)."""
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def current_config() -> QuantConfig:
    """The QuantConfig layers built now take their method from (the MoE experts' chooser reads it too)."""
    return _current


# Our fused modules and the checkpoint modules they hold: a skip entry may name either.
_FUSED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def module_skipped(prefix: str, skip: tuple[str, ...]) -> bool:
    """Whether the checkpoint leaves the module `prefix` unquantised (QuantConfig.skip_modules' forms)."""
    if not prefix or not skip:
        return False
    names = [prefix]
    for fused, parts in _FUSED_NAMES.items():
        if prefix.endswith(fused):
            names += [prefix.removesuffix(fused) + part for part in parts]
    for entry in filter(None, skip):
        if entry.startswith("re:"):
            hit = any(re.match(entry[3:], n) for n in names)
        elif any(c in entry for c in "*?["):
            hit = any(fnmatch.fnmatchcase(n, entry) or fnmatch.fnmatchcase(n, f"{entry}.*") for n in names)  # or a parent
        else:  # whole dotted components: `mlp.gate` (a router) must not match `mlp.gate_up_proj`
            pattern = re.compile(rf"(^|\.){re.escape(entry)}($|\.)")
            hit = any(pattern.search(n) for n in names)
        if hit:
            return True
    return False


def linear_method(prefix: str = "") -> LinearMethod:
    config = _current
    if config.method is not QuantMethod.UNQUANTIZED and (
        prefix in config.unquantised or module_skipped(prefix, config.skip_modules)
    ):
        log.info("%s: left unquantised by the %s checkpoint", prefix, config.method.value)
        config = QuantConfig()
    if config.method not in _REGISTRY:
        raise ValueError(f"no linear method registered for {config.method.value}")
    return _REGISTRY[config.method](config)


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, QuantLayer):
            module.quant_method.process_weights_after_loading(module)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter the model holds, measured from the tensors (shared storage, e.g. a tied LM
    head, counted once). Methods keep their repacked tensors as parameters, so they are counted too; buffers
    (rotary tables) are not weights."""
    seen: set[int] = set()
    total = 0
    for t in model.parameters():
        key = t.untyped_storage().data_ptr()
        if key in seen or t.numel() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total
