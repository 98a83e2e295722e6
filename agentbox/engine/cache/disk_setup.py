"""The engine's disk tier from its config: where (state_dir()/kvcache), how big (--disk-cache-gb, by default
a share of the free disk there), which namespace (disk_namespace.py). None when it is off or cannot be set up
(a read-only state directory is a logged warning: the server runs without the tier)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from agentbox.config import DISK_CACHE_MAX_GB, DISK_CACHE_SHARE, EngineConfig
from agentbox.engine.cache.disk_listing import disk_root
from agentbox.engine.cache.disk_namespace import namespace_for
from agentbox.engine.cache.disk_tier import DiskTier
from agentbox.engine.cache.radix_disk import DiskLink
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache

log = logging.getLogger(__name__)


def disk_budget_bytes(root: Path, disk_cache_gb: float | None) -> int:
    if disk_cache_gb is not None:
        return int(disk_cache_gb * 1024**3)
    root.mkdir(parents=True, exist_ok=True)
    return int(min(shutil.disk_usage(root).free * DISK_CACHE_SHARE, DISK_CACHE_MAX_GB * 1024**3))


def disk_link(config: EngineConfig, kv: KVCache, state: StateCache | None = None) -> DiskLink | None:
    if config.disk_cache_gb == 0:
        return None
    if config.tensor_parallel_size > 1:
        # Each rank's pool holds its heads' share of every page: a spill or a restore would have to run on
        # every rank in step, and rank 0 learn that every rank's shard verified (docs/tensor-parallel.md).
        log.info("tensor parallel %d: the disk KV tier is off", config.tensor_parallel_size)
        return None
    try:
        root = disk_root()
        budget = disk_budget_bytes(root, config.disk_cache_gb)
        ns = namespace_for(config, kv, config.tensor_parallel_size, state)
        tier = DiskTier(root, ns.key, ns.meta, kv.page_bytes, budget, restore=config.disk_restore)
    except OSError as e:
        log.warning("the disk KV tier is off: %s (%s). Fix the directory or pass --disk-cache-gb 0",
                    e.filename or "state directory", e.strerror)
        return None
    log.info("disk KV tier: %s, %.1f GiB, %d pages from before%s", tier.dir, budget / 1024**3, tier.num_pages,
             "" if config.disk_restore else " (cleared: --no-restore)")
    return DiskLink(tier, kv.page_size)
