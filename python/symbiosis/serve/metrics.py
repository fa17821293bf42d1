"""symbiosis-serve's Prometheus metrics (GET /metrics), named as vLLM names its own with the
prefix symbiosis_: time to first token and time per output token as histograms per model (the
base's name or an adapter's), requests running and waiting, tokens and requests counted per model."""
import contextlib
import time
from typing import AsyncIterator

import prometheus_client as prometheus

from .engine import Engine, TokenEvent

# vLLM's buckets, in seconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)


class Metrics:
    """The server's metrics, in a registry of its own (so that two servers in one process, as in
    tests, do not share them)."""

    def __init__(self, engine: Engine):
        self.registry = prometheus.CollectorRegistry()
        labels = ["model_name"]
        self.time_to_first_token = prometheus.Histogram(
            "symbiosis_time_to_first_token_seconds", "Time from a request's arrival to its first token",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.time_per_output_token = prometheus.Histogram(
            "symbiosis_time_per_output_token_seconds", "Time between a request's consecutive tokens",
            labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.prompt_tokens = prometheus.Counter("symbiosis_prompt_tokens", "Prompt tokens of the requests served",
                                                labels, registry=self.registry)
        self.generation_tokens = prometheus.Counter("symbiosis_generation_tokens", "Tokens generated", labels,
                                                    registry=self.registry)
        self.requests = prometheus.Counter(
            "symbiosis_request_success", "Sequences ended, by finish reason (abort: the client left before the end)",
            labels + ["finished_reason"], registry=self.registry)
        running = prometheus.Gauge("symbiosis_num_requests_running", "Sequences holding a KV cache slot",
                                   registry=self.registry)
        running.set_function(lambda: engine.running)
        waiting = prometheus.Gauge("symbiosis_num_requests_waiting", "Sequences queued for a KV cache slot",
                                   registry=self.registry)
        waiting.set_function(lambda: engine.waiting)

    def exposition(self) -> bytes:
        return prometheus.generate_latest(self.registry)

    async def metered(self, events: AsyncIterator[TokenEvent], model: str, arrived: float,
                      prompt_tokens: int) -> AsyncIterator[TokenEvent]:
        """`events` of one sequence of `model`, timed and counted as they pass (arrived: its
        time.monotonic() at arrival)."""
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        # Each token passes here: its metrics' children are looked up once.
        first_token, per_token = self.time_to_first_token.labels(model), self.time_per_output_token.labels(model)
        generated = self.generation_tokens.labels(model)
        last, finished = None, False
        async with contextlib.aclosing(events):  # leaving early cancels the request at once
            try:
                async for event in events:
                    if event.token >= 0:
                        now = time.monotonic()
                        if last is None:
                            first_token.observe(now - arrived)
                        else:
                            per_token.observe(now - last)
                        last = now
                        generated.inc()
                    if event.finish_reason is not None:
                        self.requests.labels(model, event.finish_reason).inc()
                        finished = True
                    yield event
            finally:
                if not finished:
                    self.requests.labels(model, "abort").inc()
