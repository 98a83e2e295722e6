"""Every model class follows the one protocol (models/base.py CausalLM), and what it declares is what it built:
the cache layout of a tiny model of each registered architecture names exactly the layers that write pages and
the layers that keep state. And nothing in engine/ or models/ asks a model or module what it has with getattr.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from deepseek_v4_models import tiny_config as deepseek_v4_config
from gemma4_models import configs as gemma4_configs
from gemma4_models import unified_config as gemma4_unified_config
from glm5_next_models import tiny_config as glm5_next_config
from glm_models import tiny_config as glm_config
from hybrid_models import configs as hybrid_configs
from laguna_models import tiny_config as laguna_config
from nemotron_h_models import tiny_config as nemotron_h_config
from qwen4_exp_models import text_only_config as qwen4_exp_text_config
from qwen4_exp_models import tiny_config as qwen4_exp_config
from test_models import TINY, TINY_CONFIGS
from test_models_gpt_oss import CONFIG as GPT_OSS_CONFIG
from test_models_qwen3_moe import CONFIGS as QWEN3_MOE_CONFIGS
from transformers import MistralConfig, PretrainedConfig

import agentbox
from agentbox.layers.attention import Attention
from agentbox.layers.backends.base import KVCache, KVLayerSpec
from agentbox.layers.cache_layout import CacheLayout
from agentbox.layers.compressor import Compressor
from agentbox.layers.gated_deltanet import GatedDeltaNet
from agentbox.layers.kda import KimiDeltaAttention
from agentbox.layers.mamba2 import Mamba2Mixer
from agentbox.layers.ngram_embedding import PLELayer
from agentbox.layers.window_entry_attention import WindowEntryAttention
from agentbox.layers.window_kv import WindowAttention
from agentbox.models import deepseek_v4, glm5_next, qwen4_exp
from agentbox.models.base import CausalLM
from agentbox.models.gguf_hybrid import HYBRID_CLASS
from agentbox.models.glm4_moe_lite import MLAttention, kv_spec
from agentbox.models.registry import MODEL_REGISTRY


def _named(config: PretrainedConfig, arch: str) -> PretrainedConfig:
    config.architectures = [arch]
    return config


# A tiny config for every registered architecture name (the model tests' own)
TINY_BY_ARCH: dict[str, Callable[[], PretrainedConfig]] = {
    "LlamaForCausalLM": lambda: TINY_CONFIGS["llama"],
    "MistralForCausalLM": lambda: MistralConfig(**TINY, architectures=["MistralForCausalLM"]),
    "Qwen2ForCausalLM": lambda: TINY_CONFIGS["qwen2-bias"],
    "Qwen3ForCausalLM": lambda: TINY_CONFIGS["qwen3-qknorm"],
    "Qwen3MoeForCausalLM": lambda: QWEN3_MOE_CONFIGS["norm-topk"],
    "GptOssForCausalLM": lambda: GPT_OSS_CONFIG,
    "Glm4MoeLiteForCausalLM": glm_config,
    "DeepseekV4ForCausalLM": deepseek_v4_config,
    "Glm5NextForConditionalGeneration": glm5_next_config,
    "Gemma4ForCausalLM": lambda: gemma4_configs()["moe"],
    "Gemma4ForConditionalGeneration": lambda: gemma4_configs()["dense"],
    "Gemma4UnifiedForConditionalGeneration": gemma4_unified_config,
    "Qwen3_5ForConditionalGeneration": lambda: hybrid_configs()["qwen3_5"],
    "Qwen3_5MoeForConditionalGeneration": lambda: hybrid_configs()["qwen3_5_moe"],
    "Qwen3NextForCausalLM": lambda: hybrid_configs()["qwen3_next"],
    "LagunaForCausalLM": laguna_config,
    "NemotronHForCausalLM": nemotron_h_config,
    "Qwen4ExpForConditionalGeneration": qwen4_exp_config,
    "Qwen4ExpForCausalLM": qwen4_exp_text_config,
    HYBRID_CLASS: lambda: _named(hybrid_configs()["qwen3_next"], HYBRID_CLASS),
}


def test_every_registered_architecture_has_a_tiny_config_here() -> None:
    assert set(TINY_BY_ARCH) == set(MODEL_REGISTRY)


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_the_declared_layout_is_the_built_one(arch: str) -> None:
    cls = MODEL_REGISTRY[arch]
    assert issubclass(cls, CausalLM)
    config = TINY_BY_ARCH[arch]()
    assert arch in config.architectures
    model = cls(config)
    layout = model.cache_layout()
    assert isinstance(layout, CacheLayout)
    specs = layout.kv_specs
    # Every module that writes the pool indexes the flat layer list with its layer_id, each exactly once.
    pool = [m for m in model.modules() if isinstance(m, Attention | MLAttention)]
    # DeepSeek-V4's compressed layers write their entries (and a CSA layer its indexer's keys) at two places
    entries = [(m.entry_layer, m.head_dim) for m in model.modules() if isinstance(m, deepseek_v4.Attention)
               and m.compressor is not None]
    keys = [(m.index_layer, m.indexer.head_dim) for m in model.modules() if isinstance(m, deepseek_v4.Attention)
            and m.indexer is not None]
    # GLM-5.3-Flash's indexed layers write a latent, and those that run their indexer its entries too
    indexed = [m for m in model.modules() if isinstance(m, glm5_next.IndexedAttention)]
    latents = [(m.latent_layer, m.rank) for m in indexed]
    entries += [(m.index_layer, 2 * m.indexer.dim) for m in indexed if m.indexer is not None]
    # Qwen3.8-Flash-Next's QSA layers write their K and V, and their indexer's raw key per token
    qsa = [m for m in model.modules() if isinstance(m, qwen4_exp.QSAAttention)]
    keys += [(m.index_layer, m.indexer.dim) for m in qsa]
    written = [m.layer_id for m in pool] + [m.kv_layer for m in qsa] + [i for i, _ in entries + keys + latents]
    assert sorted(written) == list(range(len(specs))), arch
    assert all(specs[m.kv_layer] == KVLayerSpec(m.num_kv_heads, m.head_dim) for m in qsa), arch
    assert all(specs[i] == KVLayerSpec(1, d, d, tied=True) for i, d in latents), arch
    for m in pool:
        want = kv_spec(config) if isinstance(m, MLAttention) else KVLayerSpec(m.num_kv_heads, m.head_dim)
        assert specs[m.layer_id] == want, (arch, m.layer_id)
    assert all(specs[i] == KVLayerSpec(1, d, tied=True) for i, d in entries + keys), arch
    # Every module with per-sequence state has its place in the state group, and that place describes it.
    stateful = [m for m in model.modules()
                if isinstance(m, WindowAttention | GatedDeltaNet | Mamba2Mixer | KimiDeltaAttention | WindowEntryAttention
                              | Compressor)]
    # A PLE layer keeps two rings: its token ids at its state_index, its conv inputs at the next
    ples = [m for m in model.modules() if isinstance(m, PLELayer)]
    if not stateful:
        assert layout.state is None and not ples
    else:
        assert layout.state is not None
        places = [m.state_index for m in stateful] + [m.state_index + j for m in ples for j in range(2)]
        assert sorted(places) == list(range(len(layout.state.specs)))
        assert all(layout.state.specs[m.state_index] == m.state_spec() for m in stateful), arch
        assert all(list(layout.state.specs[m.state_index : m.state_index + 2]) == m.state_specs() for m in ples), arch
    # The attention backend's default shape is the first paged attention layer's (MLA layers carry their own).
    first = min((m for m in pool if isinstance(m, Attention)), key=lambda m: m.layer_id, default=None)
    if first is not None:
        shape = model.attention_shape()
        assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (first.num_heads, first.num_kv_heads,
                                                                         first.head_dim), arch
    assert KVCache.bytes_per_page(specs, 16, torch.float32) > 0


def test_only_llama_stacks_offer_the_cpu_fused_decode() -> None:
    from agentbox.models.llama import LlamaModel

    for arch, make in TINY_BY_ARCH.items():
        target = MODEL_REGISTRY[arch](make()).fused_cpu_decode_target()
        llama_family = issubclass(MODEL_REGISTRY[arch], MODEL_REGISTRY["LlamaForCausalLM"])
        assert isinstance(target, LlamaModel) if llama_family else target is None, arch


def test_only_qwen3_5_layout_hybrids_offer_the_cpu_hybrid_decode() -> None:
    from agentbox.models.qwen3_5 import HybridModel

    for arch, make in TINY_BY_ARCH.items():
        target = MODEL_REGISTRY[arch](make()).fused_cpu_hybrid_target()
        qwen3_5_layout = arch.startswith("Qwen3_5") or arch == HYBRID_CLASS  # z, b and a apart (not Qwen3-Next's)
        assert isinstance(target, HybridModel) if qwen3_5_layout else target is None, arch


# Where engine/ and models/ may call getattr / hasattr: on a config (a Hugging Face config's optional fields).
CONFIG_NAMES = {"config", "text", "cfg", "self.config", "self.text_config"}
# Calls on something other than a config that probe no model or module (file, call as ast.unparse writes it)
NOT_A_PROBE = {
    ("engine/cache/disk_sessions.py", "getattr(s, f)"): "a session record's own fields, by name, written to disk",
    ("engine/sampling.py", "getattr(self, name)"): "a sampling parameter's own value, quoted in its error",
}


def probes(root: Path) -> list[str]:
    """getattr / hasattr calls under root's engine/ and models/ whose first argument is not a config."""
    found = []
    for path in sorted([*(root / "engine").rglob("*.py"), *(root / "models").rglob("*.py")]):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                continue
            call = ast.unparse(node)
            if ast.unparse(node.args[0]) not in CONFIG_NAMES and (rel, call) not in NOT_A_PROBE:
                found.append(f"{rel}:{node.lineno} {call}")
    return found


def test_engine_and_models_do_not_probe_models_with_getattr() -> None:
    found = probes(Path(agentbox.__file__).parent)
    assert not found, f"declare it on the class (models/base.py, layers/weight_loading.py) instead: {found}"


def test_the_scan_finds_a_probe(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "engine" / "a.py").write_text("x = getattr(config, 'y', 1)\nz = getattr(model, 'state_specs', None)\n")
    (tmp_path / "models" / "b.py").write_text("ok = hasattr(self.config, 'x')\nbad = hasattr(module, 'hook')\n")
    assert probes(tmp_path) == ["engine/a.py:2 getattr(model, 'state_specs', None)", "models/b.py:2 hasattr(module, 'hook')"]
