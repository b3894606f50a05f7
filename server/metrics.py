"""Prometheus metrics, served as text on the API port (``GET /metrics``).

Names follow the vLLM set with a ``clef_`` prefix (serving-and-peers.md §5b). The registry is our own, not
prometheus_client's global one, so that two servers in one process (tests) never collide and nothing a
library registers globally leaks into the scrape.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 5 ms (a tiny CPU model) to 2 min (a 24k-token prompt queued behind others).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 24576, 32768, 65536)
_REQUESTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("clef_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.failures = Counter("clef_request_failures", "Requests that failed, by error type", ["type"],
                                registry=r)
        self.queue_depth = Gauge("clef_queue_depth", "Requests waiting for a batch", registry=r)
        self.running = Gauge("clef_requests_running", "Requests in the batch on the device now", registry=r)
        self.batches = Counter("clef_batches", "Packed forwards run on the device", registry=r)
        self.batch_requests = Histogram("clef_batch_size_requests", "Requests per packed forward",
                                        buckets=_REQUESTS, registry=r)
        self.batch_tokens = Histogram("clef_batch_size_tokens", "Prompt tokens per packed forward",
                                      buckets=_TOKENS, registry=r)
        self.prompt_tokens = Counter("clef_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.prompt_tokens_hist = Histogram("clef_request_prompt_tokens", "Prompt tokens per request",
                                            buckets=_TOKENS, registry=r)
        self.queue_wait = Histogram("clef_queue_wait_seconds", "Time from enqueue to batch start",
                                    buckets=_SECONDS, registry=r)
        self.prefill = Histogram("clef_prefill_seconds", "Device time of one packed forward (prefill + head)",
                                 buckets=_SECONDS, registry=r)
        self.e2e = Histogram("clef_request_duration_seconds", "End-to-end latency of decision requests",
                             ["route"], buckets=_SECONDS, registry=r)
        self.cancelled = Counter("clef_requests_cancelled", "Queued requests dropped because the client left",
                                 registry=r)
        self.expired = Counter("clef_requests_expired", "Queued requests dropped past their deadline",
                               registry=r)
        self.device_memory = Gauge("clef_device_memory_bytes", "Device memory in use (0 on the CPU)",
                                   registry=r)
        self.ready = Gauge("clef_ready", "1 when the model is loaded, warmed and self-checked", registry=r)

    def watch_device_memory(self, read: Callable[[], int]) -> None:
        """Read device memory at scrape time, so the gauge is never stale."""
        self.device_memory.set_function(lambda: float(read()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
