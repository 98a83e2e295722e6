"""What a runner (runner.py) allocates, sized to the machine: the KV pool's pages when no size is given
(`auto_num_pages`: a share of a GPU's free memory, or on CPU what the plan counted) and the per-sequence
state cache of hybrid models and Gemma 4's rings (`state_cache`; `fit_state_slots` cuts its running rows and
snapshots to fit a small card). Each reads the runner through `Runner`, the members it needs; the state's
functions set the counts they cut there."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from agentbox.config import HOST_STATE_GB, PLAN_CONTEXT, PLAN_SESSIONS, EngineConfig
from agentbox.layers.backends.base import KVCache
from agentbox.layers.cache_layout import CacheLayout
from agentbox.layers.recurrent_state import StateCache
from agentbox.layers.window_kv import page_slack
from agentbox.models.loader import LoadedModel
from agentbox.parallel.state import control_all_gather

log = logging.getLogger(__name__)

# Share of free GPU memory the KV pool takes when no size is given: most of it (weights are already loaded).
# On CPU the pool holds what the plan counted (auto_num_pages).
GPU_KV_SHARE = 0.85
# Share of free GPU memory (after the weights) that per-sequence state (hybrid states, Gemma 4's rings) may take
# before the running requests and snapshots shrink to fit: the KV pool gets most of the rest.
GPU_STATE_SHARE = 0.5
HOST_STATE_SHARE = 0.25  # of available RAM: state snapshots that do not fit on the card (fit_state_slots)
HOST_HEADROOM = 1 << 30  # CPU: RAM left beside the KV pool (activations, the API process)


class Runner(Protocol):
    """What the sizing reads of the runner (runner.py ModelRunner), and the counts `state_cache` and
    `fit_state_slots` set on it."""

    config: EngineConfig
    loaded: LoadedModel
    layout: CacheLayout
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    tp: int
    page_size: int
    num_rows: int
    num_snapshots: int
    max_num_seqs: int
    state_in_place: bool
    num_host_snapshots: int


def state_cache(r: Runner) -> StateCache | None:
    """Hybrid models (and Gemma 4's sliding-window rings): each running sequence's state lives in the slot
    of its page-table row, its state at its last page boundary in the slot `num_rows` further (not for
    rings: the live ring is that too), then the sessions' snapshots."""
    group = r.layout.state
    if group is None or not group.specs:
        return None
    rings = page_slack(group.specs, r.page_size)
    r.state_in_place = rings is not None
    specs = rings or list(group.specs)
    # Live rows, their page-aligned copies (not for rings), then the snapshots (engine/cache/state_snapshots.py).
    per_row, per_slot = 1 if r.state_in_place else 2, StateCache.bytes_per_slot(specs, r.dtype)
    held = fit_state_slots(r, per_row, per_slot)
    slots = per_row * r.num_rows + r.num_snapshots - held
    if r.device.type == "cuda" and slots * per_slot > torch.cuda.mem_get_info(r.device)[0]:
        raise ValueError(
            f"per-sequence state takes {per_slot / 2**20:.0f} MiB x {slots} slots (per running request and "
            f"snapshot), more than this GPU has free; lower it, e.g. --max-num-seqs 1 --state-snapshots 1"
        )
    host = r.config.host_state_snapshots
    r.num_host_snapshots = min(r.num_snapshots, int(HOST_STATE_GB * 2**30 // per_slot)) if host is None else host
    # Host slots: the snapshots a small card cannot hold (`held`, numbered as snapshots), then the demoted ones.
    cache = StateCache(specs, slots, r.dtype, r.device, held + r.num_host_snapshots)
    log.info("per-sequence state: %d layers, %.2f MiB per sequence, %d session snapshots (%d in host memory), "
             "%.1f MiB on the device, %d more in host RAM for demoted snapshots", len(cache.specs),
             per_slot / 2**20, r.num_snapshots, held, slots * per_slot / 2**20, r.num_host_snapshots)
    return cache


def fit_state_slots(r: Runner, per_row: int, per_slot: int) -> int:
    """On a small card: running requests cut until their state takes at most GPU_STATE_SHARE of the smallest
    rank's free memory and leaves the KV pool the plan's context (PLAN_CONTEXT x PLAN_SESSIONS, or
    --kv-cache-gb); a Gemma 4 31B ring is 812 MiB, the default 32 rows would want 26 GiB. Snapshots (one per
    running request unless set) stay on the device while they fit there, the rest go to host memory (at most
    HOST_STATE_SHARE of what is available): a copy there at a turn's end and back at its next turn. Returns
    how many snapshots are in host memory (none on CPU)."""
    import psutil

    if r.device.type != "cuda":
        return 0
    free = torch.cuda.mem_get_info(r.device)[0]
    if r.config.kv_cache_gb is not None:
        kv = int(r.config.kv_cache_gb * 2**30)
    else:
        tokens = min(r.config.max_model_len or r.loaded.max_model_len, PLAN_CONTEXT) * PLAN_SESSIONS
        kv = int(tokens * bytes_per_token(r) / GPU_KV_SHARE)
    budget = min(control_all_gather(int(min(free * GPU_STATE_SHARE, free - kv))))
    host = min(control_all_gather(int(psutil.virtual_memory().available * HOST_STATE_SHARE / r.tp)))
    rows = max(1, min(r.num_rows, budget // (per_row * per_slot)))
    snaps = rows if r.config.state_snapshots is None else r.num_snapshots
    on_device = max(0, min(snaps, (budget - per_row * rows * per_slot) // per_slot))
    snaps = on_device + min(snaps - on_device, host // per_slot)
    if (rows, snaps) != (r.num_rows, r.num_snapshots) or snaps > on_device:
        log.warning("per-sequence state of %.0f MiB: %d running requests, %d snapshots on the GPU and %d in host "
                    "memory (--max-num-seqs and --state-snapshots choose)", per_slot / 2**20, rows, on_device,
                    snaps - on_device)
        r.num_rows, r.num_snapshots, r.max_num_seqs = rows, snaps, min(r.max_num_seqs, rows)
    return snaps - on_device


def auto_num_pages(r: Runner, page_bytes: int) -> int:
    if r.config.kv_cache_gb is not None:
        budget = int(r.config.kv_cache_gb * 2**30)
    elif r.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(r.device)
        budget = int(free * GPU_KV_SHARE)
    else:
        # What the plan counted (config.PLAN_CONTEXT x PLAN_SESSIONS), or the context asked for: RAM is
        # shared with everything else on the machine, so the pool takes what was promised, not a share of
        # what is free now. What is free now bounds only a context asked for (the plan's was planned
        # against the machine's RAM).
        context = min(r.config.max_model_len or PLAN_CONTEXT, r.loaded.max_model_len)
        pages = -(-context * PLAN_SESSIONS // r.page_size) + 1  # page 0 is the pool's null page
        import psutil

        room = psutil.virtual_memory().available - HOST_HEADROOM  # the weights are loaded by now
        if not r.config.max_model_len and context < PLAN_CONTEXT:
            # A model whose whole context is shorter than the plan's still gets the plan's tokens where RAM
            # has twice that to spare: four agents at 5k tokens each on SmolLM2 (8k) stay resident instead
            # of taking turns in one context's pages.
            planned = -(-PLAN_CONTEXT * PLAN_SESSIONS // r.page_size) + 1
            pages = planned if 2 * planned * page_bytes <= room else pages
        if r.config.max_model_len and pages * page_bytes > room:
            fits = max(0, room // page_bytes - 1) * r.page_size // PLAN_SESSIONS // 1024 * 1024
            shorter = f"serve a shorter one (--max-model-len {fits}) or " if fits else ""
            raise ValueError(f"a context of {context:,} tokens needs a KV pool of {pages * page_bytes / 2**30:.2f} GiB; "
                             f"this machine has {max(0, room) / 2**30:.2f} GiB of RAM to spare: {shorter}free memory")
        return pages
    return max(2, budget // page_bytes)


def bytes_per_token(r: Runner) -> float:
    layout = r.layout
    return KVCache.bytes_per_page(layout.kv_specs, r.page_size, r.kv_dtype,
                                  layout.tokens_per_entry) / r.page_size
