"""Models before they are served: owns the model profiles (profiles.py, over profiles/*.toml), the planner that
picks a variant and tensor-parallel size for a machine (plan.py, weight_bytes.py, gguf_moe.py), downloads
(pull.py), the canary check (verify.py) and the chain `serve` runs with no model (chain.py). It reads the
machine from hw/ and never imports the server."""
