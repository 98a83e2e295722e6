"""The cache: what the engine keeps between requests, and for whom. It owns the KV page pool, the radix tree of
cached prefixes with its eviction order, the host-RAM tier pages demote to, and the session table with its
leases (a session's pages survive its agent's tool calls). The product's core idea lives here and only here.
It must not touch execution (engine/exec: no tensors are computed here beyond page copies) or the wire
(engine/ipc); the scheduler and the core reach it through one interface, `KVManager` (manager.py: the
contract), never its fields. The policies are its implementations (cache_policies.py); a session's turns
are written by `Turns` alone (turns.py); which session a request belongs to is session_ids.py's.
"""
