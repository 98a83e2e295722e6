"""Process plumbing between the API server and the engine core: the client the server holds, the core's
process entry point, and the typed wire messages they exchange (dataclasses, never live objects). It must not
schedule, cache or execute anything; it only carries requests in and tokens and stats out.
"""
