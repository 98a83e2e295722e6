"""Find a model on disk, read its config, tokenizer and weights, and build our model class with them.

Two sources: a Hugging Face directory (config.json + safetensors, single or sharded) and a GGUF file
(config from its metadata, weights dequantised to the model dtype). Nothing here downloads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from agentbox.config import state_dir
from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.cache_layout import CacheLayout
from agentbox.layers.experts import FusedMoE
from agentbox.layers.experts import cpu as cpu_experts
from agentbox.layers.experts.placement import ExpertHome, ExpertPlacement, placement_context
from agentbox.layers.host_table import tensor_locations
from agentbox.layers.quant import QuantConfig, QuantMethod, process_weights_after_loading, quant_context
from agentbox.layers.quant.lazy import LazySlice
from agentbox.models.base import CausalLM
from agentbox.models.checkpoint_scan import tensor_infos, unquantised_linears
from agentbox.models.gguf_file import gguf_config, gguf_metadata, gguf_quant_config, gguf_weights, open_gguf
from agentbox.models.mtp import mtp_loadable
from agentbox.models.registry import model_class
from agentbox.models.weight_loader import load_weights
from agentbox.parallel.state import tp_size
from agentbox.state_files import check_seal, seal

log = logging.getLogger(__name__)

# End-of-turn tokens of common chat templates: generation must stop on them even where the checkpoint's
# eos is the end-of-document token (SmolLM2, Qwen2.5, Llama 3 instruct).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf"]
    path: Path  # a directory for hf, the .gguf file for gguf
    name: str


def resolve_model(path: str) -> ModelSource:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{str(p)!r} is a file but not a .gguf; pass a GGUF file or a model directory")
        return ModelSource("gguf", p.resolve(), p.stem)
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return ModelSource("hf", p.resolve(), p.resolve().name)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0].resolve(), ggufs[0].stem)
    if len(ggufs) > 1:
        listed = ", ".join(g.name for g in ggufs)
        raise ValueError(f"{str(p)!r} holds several GGUF files ({listed}); pass the one to load")
    raise ValueError(
        f"{str(p)!r} is neither a Hugging Face model directory (config.json + *.safetensors) nor holds a .gguf"
    )


def quant_config(src: ModelSource, config: PretrainedConfig, cls: type[CausalLM] | None = None) -> QuantConfig:
    """The checkpoint's quantisation: config.json's quantization_config (ModelOpt's hf_quant_config.json where
    config.json has none), or a GGUF file's tensor types. With the model class: an FP8 checkpoint's linears
    stored unquantised, read off its tensors (models/checkpoint_scan.py)."""
    if src.kind == "gguf":
        return gguf_quant_config(src.path)
    modelopt = src.path / "hf_quant_config.json"
    quant = QuantConfig.of(config, json.loads(modelopt.read_text()) if modelopt.is_file() else None)
    if cls is not None and quant.method is QuantMethod.FP8_BLOCK:
        found = unquantised_linears(tensor_infos(safetensors_paths(src)), cls)
        quant = replace(quant, unquantised=quant.unquantised | found)
    return quant


def load_config(src: ModelSource) -> PretrainedConfig:
    if src.kind == "gguf":
        return gguf_config(src.path)
    return AutoConfig.from_pretrained(src.path)


def safetensors_paths(src: ModelSource) -> list[Path]:
    """The checkpoint's safetensors files (those its index names, when it has one)."""
    index = src.path / "model.safetensors.index.json"
    if index.is_file():
        return [src.path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(src.path.glob("*.safetensors"))


def iter_weights(
    src: ModelSource, config: PretrainedConfig | None = None, for_engine: bool = False, unread: tuple[str, ...] = ()
) -> Iterator[tuple[str, Any]]:
    """HF-named full tensors, one at a time (a shard is open only while it is read). `for_engine`: what our
    layers' loaders take besides plain tensors: a GGUF's linear weights as `GGUFBlocks`, and under tensor
    parallelism linear weights as `LazySlice`s each rank narrows before reading. Otherwise dense tensors.
    `unread`: substrings of names never read nor yielded (the model's host tables, mapped instead)."""
    if src.kind == "gguf":
        yield from gguf_weights(src.path, config if config is not None else load_config(src), for_engine)
        return
    paths = safetensors_paths(src)
    # Under tensor parallelism a linear layer's weights come as lazy slices: each rank reads only the rows or
    # columns of its shard. Everything else (embeddings, norms, MoE experts) is read whole, as before.
    sliced = for_engine and tp_size() > 1
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if any(u in name for u in unread):
                    continue
                if sliced and _linear_tensor(name):
                    yield name, LazySlice.of(f.get_slice(name))
                else:
                    yield name, f.get_tensor(name)


_LINEAR_SUFFIXES = (
    "_proj.weight", "_proj.bias", ".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale_inv",
    ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx",  # compressed-tensors
)  # NVFP4's per-tensor global scales (`weight_scale_2`, `input_scale`, `*_global_scale`) are read whole


def _linear_tensor(name: str) -> bool:
    return name.endswith(_LINEAR_SUFFIXES) and ".experts." not in name


def load_tokenizer(src: ModelSource) -> PreTrainedTokenizerBase:
    if src.kind == "hf":
        return AutoTokenizer.from_pretrained(src.path)
    # Converting a GGUF vocabulary takes seconds; keep the converted tokenizer keyed by file identity. The copy is
    # sealed (state_files.py): one that does not verify (a truncated tokenizer.json, an edited chat template) or
    # does not load is rebuilt from the model, never trusted.
    stat = src.path.stat()
    cached = state_dir() / "tokenizers" / f"{src.name}-{stat.st_size}-{stat.st_mtime_ns}"
    if cached.is_dir():
        why = check_seal(cached)
        if why is None:
            try:
                return AutoTokenizer.from_pretrained(cached)
            except Exception as e:  # noqa: BLE001 - whatever the copy holds, the model can make it again
                why = f"does not load ({type(e).__name__})"
        log.warning("the cached tokenizer %s %s; rebuilding it from %s", cached, why, src.path)
        shutil.rmtree(cached, ignore_errors=True)
    tokenizer = _gguf_tokenizer(src.path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    tokenizer.save_pretrained(tmp)
    seal(tmp)
    try:
        os.rename(tmp, cached)  # atomic: a concurrent loader sees all of it or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return tokenizer


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The GGUF's vocabulary as a transformers tokenizer. AutoTokenizer first maps the file's architecture to a
    config to pick a tokenizer class, and has no mapping for some served ones (`deepseek2`: GLM-4.7-Flash and the
    other MLA files llama.cpp's converter writes); the vocabulary itself converts by its own kind
    (tokenizer.ggml.model), which the fast tokenizer class reads without a config."""
    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as e:
        if "is not supported" not in str(e):
            raise
        log.info("tokenizer of %s without its architecture's config (%s)", path.name, e)
        return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)


def repack_experts_for_cpu(model: nn.Module) -> None:
    """Int4 and k-bit MoE experts on a CPU, repacked for the CPU kernels (layers/experts/cpu.py; the others
    stay as loaded)."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            cpu_experts.install(module)


# What the loader does to a model once every weight is in (each layer's own conversion, `process_weights_after_loading`
# of a layer, has run in load_weights): repacking for the device's kernels, then the linear methods' conversions.
LOAD_STEPS = (repack_experts_for_cpu, process_weights_after_loading)


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: PretrainedConfig
    layout: CacheLayout  # what the model caches (`model.cache_layout()`, read once at load)
    num_heads: int  # per TP rank
    num_kv_heads: int  # per TP rank
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    source: ModelSource
    dtype: torch.dtype  # the compute dtype (a quantised parameter's own dtype says nothing of it)
    placement: ExpertPlacement | None = None  # where each MoE layer's experts live (None: no placement asked)

    @property
    def kv_specs(self) -> list[KVLayerSpec]:
        """Each paged layer's shape on this rank (layers may differ: per-layer head sizes, tied K=V)."""
        return self.layout.kv_specs

    @property
    def num_layers(self) -> int:
        """Layers with KV in the paged pool (a hybrid model's attention layers, Gemma 4's global ones)."""
        return len(self.layout.kv_specs)

    @staticmethod
    def of(
        model: CausalLM, config: PretrainedConfig, source: ModelSource, dtype: torch.dtype, eos_token_ids: list[int],
        max_model_len: int,
    ) -> LoadedModel:
        """A built model with what the engine reads of it: its cache layout and attention shape (models/base.py)."""
        shape = model.attention_shape()
        return LoadedModel(
            model=model,
            hf_config=config,
            layout=model.cache_layout(),
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            vocab_size=config.get_text_config().vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            source=source,
            dtype=dtype,
        )


def load_model(path: str, dtype: torch.dtype, device: str | torch.device, placement: ExpertPlacement | None = None,
               *, with_mtp: bool = False) -> LoadedModel:
    """The model of `path` on `device`. `placement`: the MoE layers whose experts live in host RAM
    (layers/experts/placement.py); with_mtp: with the checkpoint's multi-token-prediction head where it has one
    (models/mtp.py; `LoadedModel.model.mtp` stays None where it has none)."""
    src = resolve_model(path)
    config = load_config(src)
    cls = model_class(config)
    quant = quant_config(src, config, cls)
    if with_mtp and not mtp_loadable(quant):
        log.info("the MTP head of a %s checkpoint is not loaded: drafts come from the text alone", quant.method.value)
        with_mtp = False
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Parameters are allocated in place (torch.empty), never initialised; the checkpoint's quantisation
        # picks every linear layer's method.
        with torch.device(device), quant_context(quant), placement_context(placement):
            model = cls(config)
            if with_mtp:
                model.add_mtp_head()
    finally:
        torch.set_default_dtype(previous_dtype)
    load_weights(model, iter_weights(src, config, for_engine=True, unread=model.host_table_names))
    if model.host_table_names:
        if src.kind != "hf":
            raise ValueError(f"{type(model).__name__} maps its tables from safetensors files, not a {src.kind} file")
        model.map_host_tables(tensor_locations(safetensors_paths(src)))
    for step in LOAD_STEPS:
        step(model)
    model.eval().requires_grad_(False)
    # the text model's length: an image-text checkpoint's text config (the config itself otherwise)
    loaded = LoadedModel.of(model, config, src, dtype, eos_token_ids(src, config), _max_model_len(config.get_text_config()))
    loaded.placement = placement
    return loaded


def host_expert_bytes(model: nn.Module) -> int:
    """Bytes of the expert weights that live in host RAM (layers/experts/placement.py)."""
    return sum(p.numel() * p.element_size() for m in model.modules()
               if isinstance(m, FusedMoE) and m.home is ExpertHome.HOST for p in m.parameters())


def expert_kernels(model: nn.Module) -> list[str]:
    """Per MoE layer, in order, the class of the method its experts run (CpuExperts: the CPU kernels)."""
    return [type(m.method).__name__ for m in model.modules() if isinstance(m, FusedMoE)]


def _max_model_len(config: PretrainedConfig) -> int:
    length = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    # Configs with `layer_types` (gpt-oss, Qwen2/3) get their windows from the attention layer. Others
    # (Mistral) would run full attention where the model slides, so stop at the window there.
    if window and getattr(config, "use_sliding_window", True) and not getattr(config, "layer_types", None):
        length = min(length, int(window))
    return length


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def eos_token_ids(src: ModelSource, config: PretrainedConfig) -> list[int]:
    """Stop tokens: the checkpoint's eos ids plus the chat template's end-of-turn token when it has one."""
    ids = _as_list(getattr(config, "eos_token_id", None))
    if src.kind == "gguf":
        reader = open_gguf(src.path)
        ids += _as_list(gguf_metadata(reader, "tokenizer.ggml.eos_token_id"))
        template = gguf_metadata(reader, "tokenizer.chat_template") or ""
        tokens = gguf_metadata(reader, "tokenizer.ggml.tokens") or []
        vocab = {tok: i for i, tok in enumerate(tokens) if tok in END_OF_TURN_TOKENS}
    else:
        gen = src.path / "generation_config.json"
        if gen.is_file():
            ids += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
        template, vocab = _hf_template_and_special_tokens(src.path)
    for token in END_OF_TURN_TOKENS:
        if token == "<|end|>" and "<|channel|>" in template:
            continue  # harmony (gpt-oss): <|end|> closes one message (say, the analysis), not the turn
        if token in template and token in vocab:
            ids.append(vocab[token])
    return list(dict.fromkeys(ids))  # de-duplicated, first-seen order


def _hf_template_and_special_tokens(path: Path) -> tuple[str, dict[str, int]]:
    template, vocab = "", {}
    tok_config = path / "tokenizer_config.json"
    if tok_config.is_file():
        data = json.loads(tok_config.read_text())
        raw = data.get("chat_template") or ""
        template = raw if isinstance(raw, str) else " ".join(t.get("template", "") for t in raw)
        for token_id, entry in (data.get("added_tokens_decoder") or {}).items():
            vocab[entry.get("content", "")] = int(token_id)
    if (path / "chat_template.jinja").is_file():
        template += (path / "chat_template.jinja").read_text()
    tok_json = path / "tokenizer.json"
    if tok_json.is_file():
        for entry in json.loads(tok_json.read_text()).get("added_tokens") or []:
            vocab.setdefault(entry["content"], int(entry["id"]))
    return template, vocab
