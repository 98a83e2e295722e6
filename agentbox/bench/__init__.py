"""Benchmarks, each printing JSON (`agentbox bench ...`, docs/bench.md): owns agent-trace replay against any
OpenAI-compatible server (replay.py, synth.py, openhands.py, compare.py, report.py, spawn.py), throughput,
cache, idle, soak and grammar runs, llama.cpp comparison, and the GPU and CPU kernel timings. It reads the
trace format from agentbox/trace.py; nothing in the server imports it."""
