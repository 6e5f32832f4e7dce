"""Prometheus metrics of ``nxdc serve`` (``GET /metrics``), one registry per server."""

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


class Metrics:
    def __init__(self, batch_size: int):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("nxdc_requests_running", "Requests holding a batch row.", registry=r)
        self.waiting = Gauge("nxdc_requests_waiting", "Requests queued for a batch row.", registry=r)
        self.prompt_tokens = Counter("nxdc_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter(
            "nxdc_prompt_cached_tokens",
            "Prompt tokens reused from a row's cache (not recomputed).",
            registry=r,
        )
        self.generation_tokens = Counter("nxdc_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(
            "nxdc_requests_finished", "Finished requests by reason.", ["reason"], registry=r
        )
        self.rejected = Counter(
            "nxdc_requests_rejected", "Requests refused, by reason.", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "nxdc_time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY, registry=r
        )
        self.itl = Histogram(
            "nxdc_inter_token_latency_seconds", "Between a request's tokens.", buckets=STEP, registry=r
        )
        self.e2e = Histogram(
            "nxdc_e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY, registry=r
        )
        self.queue = Histogram(
            "nxdc_request_queue_seconds", "Arrival to a batch row.", buckets=LATENCY, registry=r
        )
        self.step = Histogram("nxdc_engine_step_seconds", "One engine iteration.", buckets=STEP, registry=r)
        self.busy_rows = Histogram(
            "nxdc_decode_busy_rows",
            "Busy batch rows per decode step.",
            buckets=tuple(range(1, batch_size + 1)),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
