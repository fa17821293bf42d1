"""symbiosis-serve: one tenant serving a model and many LoRA adapters over an OpenAI-compatible HTTP
API (docs/serving.md), every adapter's requests batched together by the C++ runtime's Generator
([Multi-adapter batches]) while the base layers run on the shared executor.

    symbiosis-serve --model /models/llama --executor tcp://127.0.0.1:5555 --lora-modules alice=runs/alice/adapter

engine.py: the Generator stepping on its own thread, each request an async stream of tokens;
protocol.py: OpenAI's request bodies, checked; app.py: the HTTP API (FastAPI on uvicorn);
metrics.py: Prometheus metrics; cli.py: the command line."""
from .engine import Engine, SamplingParams, TokenEvent

__all__ = ["Engine", "SamplingParams", "TokenEvent"]
