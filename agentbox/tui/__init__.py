"""`agentbox top`: the live dashboard (app.py), its panels (panels.py) and session table (session_table.py), how a
figure shows (fmt.py), one poll of the server and this machine (snapshot.py), rates from counter deltas (rates.py),
the HTTP client (client.py) and local probes (machine.py). Reads the server over HTTP only."""

DEFAULT_INTERVAL_S = 1.0  # `agentbox top --interval`: one poll a second is live enough and costs the server ~nothing
