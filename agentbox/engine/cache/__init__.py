"""The cache: what the engine keeps between requests, and for whom, in the layout the model declares. It owns the
page pool every paged group shares, the radix tree of cached prefixes with its eviction order, the state group's
snapshots, the tiers below the device (host RAM, disk), the rows running requests hold, and the session table
with its leases (a session's pages survive its agent's tool calls). The product's core idea lives here and only
here. It must not touch execution (engine/exec: no tensors are computed here beyond page and slot copies) or the
wire (engine/ipc); the scheduler and the core reach it through one interface, `CacheManager` (manager.py), and
see only its `Match`, `Lock` and a request's handle. The page policies are cache_policies.py's; a session's
turns are written by `Turns` alone (turns.py); which session a request belongs to is session_ids.py's.
"""
