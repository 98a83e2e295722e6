"""The HTTP API process: owns the FastAPI app (app.py), its OpenAI, Anthropic and Responses routes and their
protocol models, the one streaming loop they share (generation.py), the state routes read (state.py), the
session key a request carries (session_key.py), errors, guards, metrics and the traffic recorder
(trace_recorder.py). It talks to the engine only through engine/ipc's client and never runs the model."""
