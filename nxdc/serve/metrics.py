"""Prometheus metrics of ``nxdc serve`` (``GET /metrics``), one registry per server. Every
series carries a ``model_name`` label (the served model id), as vLLM's do, so that dashboards
built for vLLM can select by it; docs/serve.md maps each nxdc name to vLLM's."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `_created` series beside every counter and histogram

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _ByReason:
    """A counter labelled (model_name, reason), with the model fixed: ``.labels(reason)``."""

    def __init__(self, counter: Counter, model: str):
        self.counter, self.model = counter, model

    def labels(self, reason: str):
        return self.counter.labels(self.model, reason)


class Metrics:
    def __init__(self, batch_size: int, model_name: str):
        r = self.registry = CollectorRegistry()
        self.batch_size = batch_size

        def one(kind, name: str, doc: str, **kw):
            return kind(name, doc, ["model_name"], registry=r, **kw).labels(model_name)

        def by_reason(name: str, doc: str) -> _ByReason:
            return _ByReason(Counter(name, doc, ["model_name", "reason"], registry=r), model_name)

        self.running = one(Gauge, "nxdc_requests_running", "Requests holding a batch row.")
        self.waiting = one(Gauge, "nxdc_requests_waiting", "Requests queued for a batch row.")
        self.rows_in_use = one(
            Gauge, "nxdc_kv_cache_rows_in_use", "Batch rows (KV caches) held by a request."
        )
        self.cache_usage = one(
            Gauge, "nxdc_kv_cache_usage_ratio", "Fraction of the batch rows (KV caches) in use, 0 to 1."
        )
        self.prompt_tokens = one(Counter, "nxdc_prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = one(
            Counter, "nxdc_prompt_cached_tokens", "Prompt tokens reused from a row's cache (not recomputed)."
        )
        self.generation_tokens = one(Counter, "nxdc_generation_tokens", "Tokens generated.")
        self.finished = by_reason(
            "nxdc_requests_finished", "Requests the engine took, once each, by how they ended."
        )
        self.rejected = by_reason("nxdc_requests_rejected", "Requests refused before the engine, by reason.")
        self.ttft = one(
            Histogram, "nxdc_time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY
        )
        self.itl = one(
            Histogram, "nxdc_inter_token_latency_seconds", "Between a request's tokens.", buckets=STEP
        )
        self.e2e = one(Histogram, "nxdc_e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY)
        self.queue = one(Histogram, "nxdc_request_queue_seconds", "Arrival to a batch row.", buckets=LATENCY)
        self.step = one(Histogram, "nxdc_engine_step_seconds", "One engine iteration.", buckets=STEP)
        self.busy_rows = one(
            Histogram,
            "nxdc_decode_busy_rows",
            "Busy batch rows per decode step.",
            buckets=tuple(range(1, batch_size + 1)),
        )

    def set_rows(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.rows_in_use.set(running)
        self.cache_usage.set(running / self.batch_size)

    def render(self) -> bytes:
        return generate_latest(self.registry)
