"""Prometheus metrics, served as text on the API port (``GET /metrics``).

Names follow the vLLM set with a ``clef_`` prefix (serving-and-peers.md §5b).

One process: the registry is our own, not prometheus_client's global one, so that two servers in one
process (tests) never collide and nothing a library registers globally leaks into the scrape.

One process on several devices (``--spread queue``): one registry; the busy counter has a series per device
(its ``lane``), the other values are the pod's.

Several workers (``--spread workers`` with ``--workers N`` or ``--device a,b``): the supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` before it starts them, so every value is written to a per-process file there, and a
scrape, whichever worker the kernel hands it to, merges all the files (prometheus_client's MultiProcessCollector):
counters and histograms are summed over workers, dead ones included, since what they counted happened. Each gauge
says how its workers combine (``multiprocess_mode``, chosen per gauge below); the ``live*`` modes forget a worker
once the supervisor marks it dead.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from clefcore.engine import EngineStatus

from . import admission, errors
from .engine_status import describe

# Latency buckets from 5 ms (a tiny CPU model) to 2 min (a 24k-token prompt queued behind others).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 24576, 32768, 65536)
_REQUESTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
# How late the event loop runs a timer: a refusal or a health probe waits at least this long.
_LAG = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LOOP_LAG_INTERVAL_S = 0.02

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The shared directory when this process is one of several workers, else None."""
    return os.environ.get(MULTIPROC_ENV) or None


def clear_multiprocess_dir() -> None:
    """Remove every process's value files: only before any worker of this run has written one."""
    path = multiprocess_dir()
    if path is not None and os.path.isdir(path):
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.unlink(os.path.join(path, name))


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("clef_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.failures = Counter("clef_request_failures", "Requests that failed, by error type", ["type"],
                                registry=r)
        # Requests waiting or running anywhere in the pod: the sum over live workers.
        self.queue_depth = Gauge("clef_queue_depth", "Requests waiting for a batch", registry=r,
                                 multiprocess_mode="livesum")
        self.running = Gauge("clef_requests_running", "Requests in the batch on the device now", registry=r,
                             multiprocess_mode="livesum")
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
        self.prepare_wait = Histogram("clef_prepare_wait_seconds", "Time a read body waited for a prepare thread "
                                      "(validation, decoding, tokenization), smallest bodies first",
                                      buckets=_SECONDS, registry=r)
        self.prefill = Histogram("clef_prefill_seconds", "Device time of one packed forward (prefill + head)",
                                 buckets=_SECONDS, registry=r)
        # route: as on clef_requests_total (the route's path), or "library" for an embedding program's calls
        self.e2e = Histogram("clef_request_duration_seconds", "End-to-end latency of decision requests",
                             ["route"], buckets=_SECONDS, registry=r)
        # Admission by work (server/admission.py): what is waiting, in tokens and in expected seconds, and
        # what was refused and why (queued_work: over the wait budget; queue_full: over --max-queue).
        self.queued_tokens = Gauge("clef_queued_tokens", "Prompt tokens accepted and not yet answered: "
                                   "queued, running and the rest of chunked prompts", registry=r,
                                   multiprocess_mode="livesum")
        self.held_tokens = Gauge("clef_held_tokens", "Estimated prompt tokens of bodies past the arrival check "
                                 "that are being read and prepared: work ahead of later arrivals until queued",
                                 registry=r, multiprocess_mode="livesum")
        # livemax: the worst worker is what a client routed there waits.
        self.estimated_wait = Gauge("clef_estimated_wait_seconds", "Expected wait of a request arriving "
                                    "now (queued tokens / measured rate)", registry=r,
                                    multiprocess_mode="livemax")
        self.device_rate = Gauge("clef_device_rate_tokens_per_second", "Measured prompt tokens per second of "
                                 "device time (smoothed)", registry=r, multiprocess_mode="liveall")
        self.step_tokens = Gauge("clef_step_tokens", "Most prompt tokens of one device step now, by limit "
                                 "(max_batch_tokens, chunk_tokens; auto ones follow the measured rate)", ["limit"],
                                 registry=r, multiprocess_mode="liveall")
        # size: the prompt's tokens up to this bound (admission.SIZE_CLASSES; the estimate from the body's
        # size when refused unread, "unknown" when there was none)
        self.rejected = Counter("clef_requests_rejected", "Requests refused with 429 by reason (queued_work, "
                                "queue_full, evicted) and prompt size", ["reason", "size"], registry=r)
        # The loadtest (and a dashboard) takes the devices' busy fraction from this counter's rate, over
        # clef_devices. lane: the device's place in --device, whether one Service drives several devices or
        # each worker of --spread workers drives one.
        self.device_busy = Counter("clef_device_busy_seconds", "Seconds the device spent running forwards "
                                   "and chunk steps, by lane (the device's place in --device)", ["lane"],
                                   registry=r)
        self.chunk_steps = Counter("clef_chunk_steps", "Chunks of long prompts run (chunked prefill)",
                                   registry=r)
        self.cancelled = Counter("clef_requests_cancelled", "Queued requests dropped because the client left",
                                 registry=r)
        self.expired = Counter("clef_requests_expired", "Queued requests dropped past their deadline",
                               registry=r)
        self.fallbacks = Counter("clef_precision_fallbacks", "Batches answered again on the exact precision "
                                 "path after the fast path's guard tripped", registry=r)
        # One series per worker (pid label): each worker has its own GPU, and a sum would hide the one
        # that is close to full.
        self.device_memory = Gauge("clef_device_memory_bytes", "Device memory in use, by lane (the device's place "
                                   "in --device; 0 on the CPU)", ["lane"], registry=r, multiprocess_mode="liveall")
        # Device trouble (server/device_watch.py). livemax: one stalled worker is enough to say so.
        self.device_stalled = Gauge("clef_device_stalled", "1 while a call on a device has run past its stall "
                                    "limit (--stall-timeout, or 4x its expected time if longer)", registry=r,
                                    multiprocess_mode="livemax")
        self.device_faults = Counter("clef_device_faults", "Device-level failures detected, by kind: stall (a "
                                     "call past its stall limit), self_check (the self-check after a device "
                                     "error failed), lost (the device process ended)", ["kind"], registry=r)
        # 1 only while every live worker is ready: one still loading makes the pod not ready.
        self.ready = Gauge("clef_ready", "1 when /health answers 200: the model is loaded, warmed and self-checked, "
                           "and no device is stalled or faulted", registry=r,
                           multiprocess_mode="livemin")
        self.workers = Gauge("clef_workers", "Server processes alive (one per device with --spread workers)",
                             registry=r, multiprocess_mode="livesum")
        self.devices = Gauge("clef_devices", "Devices the live server processes run forwards on", registry=r,
                             multiprocess_mode="livesum")
        # Labels say what the engine runs as (device, precision mode); the value is always 1. Workers that
        # agree collapse into one series.
        self.engine_info = Gauge("clef_engine_info", "The loaded engine: device and precision mode",
                                 ["device", "precision"], registry=r, multiprocess_mode="livemax")
        self.loop_lag = Histogram("clef_event_loop_lag_seconds", "How late the server's event loop woke a timer "
                                  f"set every {LOOP_LAG_INTERVAL_S * 1000:.0f} ms: the delay HTTP work (429s, "
                                  "probes) saw from the loop being busy", buckets=_LAG, registry=r)
        # Every known label value from the start, at 0: a panel or a ratio shows 0 before the first event, not
        # "No data".
        for reason in admission.Reason:
            for size in admission.SIZE_LABELS:
                self.rejected.labels(reason.value, size)
        for kind in errors.SERVER_KINDS:
            self.failures.labels(kind)
        self.workers.set(1)
        self._fallbacks_seen = 0

    async def watch_loop_lag(self) -> None:
        """Until cancelled: sleep LOOP_LAG_INTERVAL_S at a time and observe how much later than asked the loop
        came back."""
        while True:
            asked = time.monotonic()
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            self.loop_lag.observe(max(0.0, time.monotonic() - asked - LOOP_LAG_INTERVAL_S))

    def watch_engine(self, engine: EngineStatus, lanes: Mapping[str, EngineStatus] | None = None) -> None:
        """Call once the engine is loaded and self-checked: its identity, and its first counts. ``engine``: the
        engines' status together; ``lanes``: each device's own by its lane (None: one device, lane 0)."""
        status = describe(engine)
        self.engine_info.labels(engine.device, engine.mode).set(1)
        if "cublas" in status:  # GPU engines only: on the CPU there is no cuBLAS to miss
            # 0 when cuBLAS could not be loaded and every GEMM runs clefcore's own kernels; livemin: one such
            # worker is enough to say so.
            cublas = Gauge("clef_cublas_available", "1 when cuBLAS is loaded, 0 when every GEMM runs "
                           "clefcore's own kernels", registry=self.registry, multiprocess_mode="livemin")
            cublas.set(1 if status["cublas"] else 0)
        self.after_batch(lanes if lanes is not None else {"0": engine})  # the self-check's fallbacks count too

    def after_batch(self, lanes: Mapping[str, EngineStatus]) -> None:
        """After every packed forward or chunk step: what changed inside the engines, each device's by its lane,
        as its device process reported it with its last step: their precision fallbacks together, and each
        one's device memory. Each worker writes its own values, so a scrape answered by another worker still
        sees them."""
        seen = sum(status.fallbacks for status in lanes.values())  # the engines' own counts since they loaded
        if seen > self._fallbacks_seen:
            self.fallbacks.inc(seen - self._fallbacks_seen)
        self._fallbacks_seen = seen
        for lane, status in lanes.items():
            self.device_memory.labels(lane).set(float(status.memory_in_use))

    def render(self) -> bytes:
        path = multiprocess_dir()
        if path is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=path)
        return generate_latest(registry)
