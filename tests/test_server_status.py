"""What /health and /metrics say about the engine (server/engine_status.py, server/metrics.py), from the status
the device process reports: a GPU engine that could not load cuBLAS, one that could (its backend status from
CudaOps.status, no GPU needed), and the CPU engine over the real numpy backend."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest

from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda.ops import CudaOps
from clefcore.engine import EngineStatus
from clefcore.server.engine_status import describe
from clefcore.server.metrics import Metrics


def gpu_engine(cublas_missing, fallbacks=0, arena=None, tables=None):
    ctx = SimpleNamespace(cublas_missing=cublas_missing, caches=SimpleNamespace(upload_arena=tables))
    backend = CudaOps.status(SimpleNamespace(ctx=ctx, arena=arena))
    return EngineStatus("m", "cuda:0", "fast", None, backend, fallbacks, 1234)


def cpu_engine():
    return EngineStatus("m", "cpu", "fp32", None, CpuOps().status(), 0, 0)


def sample(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name]
    return float(line.rsplit(" ", 1)[1])


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)


def test_describe():
    missing = "libcublasLt.so.12: cannot open shared object file"
    assert describe(gpu_engine(missing, 2)) == {"precision": "fast", "cublas": False, "reserved_bytes": 0,
                                                "reserve_overflows": 0, "cublas_missing": missing,
                                                "precision_fallbacks": 2}
    reserved = SimpleNamespace(capacity=3 << 30, overflows=5)     # clefcore.pool.Arena's counters
    tables = SimpleNamespace(capacity=16 << 20, overflows=1)       # the index tables' arena counts too
    assert describe(gpu_engine(None, arena=reserved, tables=tables)) == {
        "precision": "fast", "cublas": True, "reserved_bytes": (3 << 30) + (16 << 20), "reserve_overflows": 6,
        "precision_fallbacks": 0}
    assert describe(cpu_engine()) == {"precision": "fp32", "precision_fallbacks": 0}


@pytest.mark.parametrize("missing, available", [("no libcublas", 0.0), (None, 1.0)])
def test_metrics_show_cublas_and_the_engine(missing, available):
    metrics = Metrics()
    metrics.watch_engine(gpu_engine(missing))
    text = metrics.render().decode()
    assert sample(text, "clef_cublas_available") == available
    assert 'clef_engine_info{device="cuda:0",precision="fast"} 1.0' in text
    assert sample(text, "clef_device_memory_bytes") == 1234


def test_device_memory_is_one_series_per_lane():
    metrics = Metrics()
    first, second = (dataclasses.replace(gpu_engine(None), memory_in_use=n) for n in (100, 200))
    metrics.watch_engine(dataclasses.replace(first, memory_in_use=300), {"0": first, "1": second})
    text = metrics.render().decode()
    assert 'clef_device_memory_bytes{lane="0"} 100.0' in text and 'clef_device_memory_bytes{lane="1"} 200.0' in text
    metrics.after_batch({"0": first, "1": dataclasses.replace(second, memory_in_use=250)})
    assert 'clef_device_memory_bytes{lane="1"} 250.0' in metrics.render().decode()
    metrics.after_batch({"0": dataclasses.replace(first, fallbacks=1), "1": dataclasses.replace(second, fallbacks=2)})
    assert sample(metrics.render().decode(), "clef_precision_fallbacks_total") == 3   # the devices' together


def test_fallbacks_counter_follows_the_engine():
    metrics, engine = Metrics(), gpu_engine(None, fallbacks=1)
    metrics.watch_engine(engine)  # e.g. the self-check fell back once
    assert sample(metrics.render().decode(), "clef_precision_fallbacks_total") == 1
    engine = dataclasses.replace(engine, fallbacks=3)
    metrics.after_batch({"0": engine})
    metrics.after_batch({"0": engine})  # read twice, counted once
    assert sample(metrics.render().decode(), "clef_precision_fallbacks_total") == 3


def test_the_loop_lag_histogram_sees_a_blocked_loop():
    """watch_loop_lag: samples every LOOP_LAG_INTERVAL_S; a callback that holds the loop 0.2 s lands in the
    0.25 s bucket and not below 0.1 s, the other samples in the low ones."""
    metrics = Metrics()

    async def run():
        watch = asyncio.ensure_future(metrics.watch_loop_lag())
        await asyncio.sleep(0.1)
        time.sleep(0.2)                    # the loop held, as a long piece of work on it would
        await asyncio.sleep(0.1)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(run())
    text = metrics.render().decode()
    count = sample(text, "clef_event_loop_lag_seconds_count")
    buckets = {line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("clef_event_loop_lag_seconds_bucket")}
    assert count >= 6 and buckets["0.1"] == count - 1 and buckets["0.25"] == count   # one sample waited ~0.2 s
