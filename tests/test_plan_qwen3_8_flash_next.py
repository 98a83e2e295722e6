"""Qwen3.8-Flash-Next (qwen4_exp, issue 46) in the planner: its profile counts the shape of transformers' reference
config (parameters, the n-gram table, the KV and state the engine's own layout classes allocate for it), and its
n-gram table is planned in host RAM, never in VRAM: on one RTX 5090 with 128 GiB the NVFP4 release runs with the
table and the experts that do not fit the card in RAM; on one RTX 4090 with 64 GiB the table is read from disk, the
plan says how much and at what cost, and names the NVFP4 path the card takes (issue 48)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM
from typer.testing import CliRunner

from agentbox.cli.main import app
from agentbox.config import GPU_PAGE_SIZE
from agentbox.hub.engine_support import engine_rejection
from agentbox.hub.plan import Candidate, Plan, PlanConfig, plan
from agentbox.hub.profiles import Profile, find_profile
from agentbox.hub.weight_bytes import resident_weight_bytes
from agentbox.hw.probe import GIB, Probe
from agentbox.layers.backends.base import KVCache, KVLayerSpec
from agentbox.layers.recurrent_state import LinearStateSpec, StateCache
from agentbox.models.qwen4_exp import Qwen4ExpForCausalLM as EngineModel

HW = Path(__file__).parents[1] / "profiles" / "hardware"
NAME = "Qwen3.8-Flash-Next"


def reference_config(prof: Profile) -> Qwen4ExpTextConfig:
    """transformers' defaults at the profile's 48 layers, with the QSA indexer and the PLE layer the profile plans."""
    return Qwen4ExpTextConfig(
        num_hidden_layers=prof.layers, ple_layer_ids=[1], ple_embed_dim=2560, eos_token_id=248046,
        indexer_n_heads=32, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )


@pytest.fixture(scope="module")
def profile() -> Profile:
    return find_profile(NAME)


def test_profile_counts_the_reference_shape(profile: Profile) -> None:
    cfg = reference_config(profile)
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(cfg)
    params = dict(model.named_parameters())
    table = sum(p.numel() for n, p in params.items() if n.endswith("ngram_embedding.weight"))
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    trunk = sum(p.numel() for p in params.values()) - table
    assert (trunk, table, experts) == (profile.params, profile.ngram_table_params, profile.expert_params)
    assert profile.active_params == trunk - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    assert (profile.experts, profile.experts_per_token) == (cfg.num_experts, cfg.num_experts_per_tok)
    assert profile.ngram_rows_per_token == len(cfg.ple_layer_ids) * (cfg.ngram_size - 1) * cfg.heads_per_ngram

    # KV: each QSA layer's K and V, and its indexer's raw key (one head, kept like GLM-5.3's index entries), as
    # the engine's pool lays pages out
    qsa = cfg.layer_types.count("indexed_attention")
    assert qsa == profile.kv_layers_ == 12
    specs = ([KVLayerSpec(cfg.num_key_value_heads, cfg.head_dim)] * qsa
             + [KVLayerSpec(cfg.indexer_kv_heads, cfg.indexer_head_dim, tied=True)] * qsa)
    page = GPU_PAGE_SIZE
    assert profile.kv_bytes_per_token(2) == KVCache.bytes_per_page(specs, page, torch.bfloat16) / page == 27648

    # State a slot: each DeltaNet layer's conv inputs and matrices; each PLE layer's dilated conv inputs (the 4
    # streams) and the last n-1 token ids (int64, the n-gram context)
    delta = LinearStateSpec(2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                            + cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim - 1,
                            cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    ple_conv = cfg.hc_count * cfg.hidden_size * (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size * 2
    ple_ids = (cfg.ngram_size - 1) * 8
    linear = cfg.layer_types.count("linear_attention")
    assert profile.state_bytes == linear * delta.bytes(torch.bfloat16) + len(cfg.ple_layer_ids) * (ple_conv + ple_ids)


def test_engine_runs_it_and_the_table_is_never_in_vram(profile: Profile) -> None:
    table = profile.ngram_table_bytes
    assert table == profile.ngram_table_params * 2
    for v in profile.variants:
        assert engine_rejection(profile, v) is None, v.name
    nv, fp8, bf16 = profile.variant("nvfp4"), profile.variant("fp8"), profile.variant("bf16")
    # the quantised releases stay as stored, less the table; bf16 is the trunk's parameters at 2 bytes
    assert resident_weight_bytes(profile, nv, "cuda") == nv.size - table
    assert resident_weight_bytes(profile, fp8, "cuda") < fp8.size - table + profile.params * 0.02
    assert resident_weight_bytes(profile, bf16, "cuda") == profile.params * 2


def machine(name: str, ram_gib: int | None = None) -> Probe:
    probe = Probe.load(HW / f"{name}.json")
    if ram_gib is not None:
        probe.host = replace(probe.host, ram_total=ram_gib * GIB, ram_free=(ram_gib - 2) * GIB)
    return probe


def cand(p: Plan, variant: str) -> Candidate:
    return next(c for c in p.candidates if c.variant.name == variant)


def test_one_5090_with_128g_runs_nvfp4_with_the_table_in_ram(profile: Profile) -> None:
    probe = machine("1x-rtx5090-128g")
    p = plan(profile, probe, PlanConfig())
    c = p.chosen
    assert c is not None and c.variant.name == "nvfp4" and c.tp == 1
    assert c.split is not None and c.table is not None and c.table.in_ram
    # on the card: the rest and the experts past the first N layers; in RAM: those N layers' experts, the
    # reserve and the whole table, within the machine's RAM
    assert c.need_per_device <= c.available_bytes and c.weights_bytes < resident_weight_bytes(profile, c.variant, "cuda")
    assert c.table.others_bytes == c.split.host_need
    assert c.split.host_need + profile.ngram_table_bytes <= probe.host.ram_total
    assert c.split.tok_s > PlanConfig().min_tok_s
    # fp8 runs too, with more bits, but its experts leave the table no room: it reads rows from disk, ranked after
    fp8 = cand(p, "fp8")
    assert fp8.ok and fp8.table is not None and not fp8.table.in_ram and p.candidates.index(fp8) > 0
    assert fp8.table.short == fp8.split.host_need + profile.ngram_table_bytes - probe.host.ram_total  # type: ignore[union-attr]
    # with RAM for fp8's table as well (not bf16's), the ranking is by bits again: the table arithmetic alone moved it
    roomy = plan(profile, machine("1x-rtx5090-128g", ram_gib=192), PlanConfig())
    f, n = cand(roomy, "fp8"), cand(roomy, "nvfp4")
    assert f.ok and f.table is not None and f.table.in_ram and n.table is not None and n.table.in_ram
    assert (roomy.candidates.index(f) < roomy.candidates.index(n)) == (f.slow == n.slow)


def test_plan_command_shows_the_table_in_the_arithmetic(profile: Profile) -> None:
    out = CliRunner().invoke(app, ["plan", NAME, "--hardware", str(HW / "1x-rtx5090-128g.json")])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # the plan wraps at the terminal's width (80 columns without one)
    assert "80.7B params + a 51.2B n-gram table in host RAM, MoE" in text
    c = plan(profile, machine("1x-rtx5090-128g"), PlanConfig()).chosen
    assert c is not None and c.split is not None and c.table is not None
    assert (f"a token gathers 16 rows): 95.4 + {c.split.host_need / GIB:.1f} experts in RAM and reserve = "
            f"{(c.split.host_need + profile.ngram_table_bytes) / GIB:.1f} GiB <= 128.0 GiB of RAM") in text
    assert f"plan: {NAME}:nvfp4 at tp=1 with --n-cpu-moe {c.split.in_ram} (routed experts in host RAM)" in text


def test_one_4090_with_64g_reads_the_table_from_disk_and_names_the_w4a16_path(profile: Profile) -> None:
    probe = machine("1x-rtx4090")
    config = PlanConfig()
    p = plan(profile, probe, config)
    c = p.chosen
    assert c is not None and c.variant.name == "nvfp4" and c.split is not None and c.table is not None
    t = c.table
    assert not t.in_ram and t.short == profile.ngram_table_bytes + c.split.host_need - probe.host.ram_total
    # a row that misses RAM is one random read: the share of rows missing is the share of the table on disk
    share = t.short / profile.ngram_table_bytes
    assert t.decode_disk_s == pytest.approx(16 * share * config.assumed_disk_read_ms / 1e3)
    assert t.prefill_disk_s == pytest.approx(p.context * t.decode_disk_s)
    note = next(n for n in c.notes if n.startswith("n-gram table in host RAM"))
    assert (f"{t.short / GIB:.1f} GiB of it stays on disk, so {share:.0%} of the rows gathered are read from disk" in note
            and f"+{t.prefill_disk_s:.1f} s a 32,768-token prefill; {t.short / GIB:.1f} GiB more RAM keeps it in RAM"
            in note)
    assert any(n.startswith("nvfp4 on sm_89 (no FP4 tensor cores): the Triton W4A16 path") and "weights stay 4.5 bits"
               in n for n in c.notes)


def test_models_without_a_table_plan_none() -> None:
    p = plan(find_profile("Qwen3.8-27B"), machine("1x-rtx5090"), PlanConfig())
    assert p.candidates and all(c.table is None and not c.table_on_disk for c in p.candidates)


def test_profile_counts_what_the_engine_allocates(profile: Profile) -> None:
    """The engine's own model of the reference shape (agentbox's Qwen4ExpForCausalLM on the meta device) declares
    the cache the profile plans: its pages' bytes a token and its state group's bytes a slot."""
    cfg = reference_config(profile)
    with torch.device("meta"):
        model = EngineModel(cfg)
    layout = model.cache_layout()
    page = GPU_PAGE_SIZE
    per_page = KVCache.bytes_per_page(layout.kv_specs, page, torch.bfloat16, layout.tokens_per_entry)
    assert profile.kv_bytes_per_token(2) == per_page / page
    assert layout.state is not None
    assert profile.state_bytes == StateCache.bytes_per_slot(list(layout.state.specs), torch.bfloat16)


def test_the_issues_command_on_1x_rtx5090_json(profile: Profile) -> None:
    """`agentbox plan Qwen3.8-Flash-Next --hardware profiles/hardware/1x-rtx5090.json` (128 GiB of RAM in its
    description) chooses nvfp4 with the whole table in RAM."""
    c = plan(profile, Probe.load(HW / "1x-rtx5090.json"), PlanConfig()).chosen
    assert c is not None and c.variant.name == "nvfp4" and c.table is not None
    assert c.split is not None and c.split.host_need + profile.ngram_table_bytes <= 128 * GIB
