"""``clefcore bench``'s end-to-end cases: decisions (backbone + head, in-process, as ``Engine.forward`` runs them)
at each prompt length and packed, timed on the wall clock, with the GPU memory each needs beyond the weights and
the route each of its GEMM shapes took."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from .records import QUESTION_TOKENS, record
from .timing import spread


class PeakInUse:
    """CuPy allocator wrapper that records the default pool's in-use bytes right after every allocation: in-use
    memory only grows at an allocation, so the largest sample is the exact high-water of live arrays. Reading
    ``used_bytes()`` walks the pool's chunk list, so use it for an untimed run only."""

    def __init__(self, cp):
        self.cp = cp
        self.pool = cp.get_default_memory_pool()
        self.peak = 0
        self._ctx = None

    def malloc(self, nbytes):
        mem = self.pool.malloc(nbytes)
        used = self.pool.used_bytes()
        if used > self.peak:
            self.peak = used
        return mem

    def __enter__(self):
        self.peak = self.pool.used_bytes()
        self._ctx = self.cp.cuda.using_allocator(self.malloc)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _device_used(cp):
    free, total = cp.cuda.runtime.memGetInfo()
    return total - free


def _packed(records):
    """The packed stream of ``records``: token ids, cu_seqlens and positions, as Engine.forward builds them."""
    from ..engine import packed_positions
    ids = np.concatenate([r.input_ids for r in records])
    cu = np.concatenate([[0], np.cumsum([len(r.input_ids) for r in records])])
    return ids, cu, packed_positions(records)


def forward_run(ops, params, records, vp=None, image=None):
    """One call = what Engine.forward does for ``records`` (the head queued before the guard read). With
    ``image`` for records[0]'s one image, each call first makes its pixels on the host: from file bytes, decoding
    then preprocessing; from a decoded [H, W, 3] uint8 array, preprocessing only. Then the vision tower (``vp``)
    runs before the backbone."""
    from .. import images
    from ..engine import image_inputs
    from ..model.backbone import backbone
    from ..model.head import heads
    from ..preprocess import preprocess
    ids, cu, pos = _packed(records)

    def run():
        recs = records
        if image is not None:
            rgb = images.decode(image, 0) if isinstance(image, bytes) else image
            recs = [replace(records[0], images=(preprocess(rgb),))] + records[1:]
        rows, embeds = image_inputs(ops, vp, recs)
        hs, _ = backbone(ops, params, ids, cu, pos, check=False, image_rows=rows, image_embeds=embeds)
        outs = heads(ops, params, hs, ids, cu, [r.questions for r in recs])
        ops.check_watched()
        return outs
    return run


def state_series(lens, bucket: int, n: int, vocab: int, rng) -> list[list]:
    """``n`` streams of a case as one client sends them: records (records.record, so the case's question schema)
    of the case's lengths ``lens`` with fresh random tokens, each stream's states cut short by a different number
    of tokens (distinct totals while the states leave room for them), the total staying within the case's
    ``bucket``-token bucket: state lengths that the case's graphs serve. The first stream has the case's own
    lengths."""
    T = sum(lens)
    states = [max(0, L - QUESTION_TOKENS) for L in lens]
    room = min((T - 1) % bucket, sum(states))              # tokens that can go, the total staying in its bucket
    cuts = [0] * n
    if room:
        cuts[1:] = rng.choice(np.arange(1, room + 1), size=n - 1, replace=n - 1 > room).tolist()
    order = sorted(range(len(lens)), key=lambda j: states[j])  # the shortest states first: the rest take the surplus
    out = []
    for cut in cuts:
        left, ls = cut, list(lens)
        for k, j in enumerate(order):                     # spread over the records, each within its state
            take = min(states[j], -(-left // (len(order) - k)))
            ls[j] -= take
            left -= take
        out.append([record(rng.integers(0, vocab, L)) for L in ls])
    return out


def breakdown(cp, ops, params, lens, reps, rng) -> dict:
    """Where a forward of a case (records of lengths ``lens``) spends its time, for short prompts whose host time
    matters: the backbone (a CUDA graph where one fits) and the joint head, each timed to the GPU's end
    (``*_ms``), and the head's host time alone (``head_launch_ms``: until its last launch returns, no
    synchronisation). ``head_ms`` includes the guards' read, as Engine.forward's head does. Median of ``reps``.

    Timed as users meet it: not one request again and again (graphs keyed on exact positions would replay there
    and nowhere else), but a series of the case's schema whose states differ in length (``state_series``), after
    a warm-up run of the case itself. ``series_tokens``: each timed run's tokens; ``head_graph_replays``: of the
    timed runs, those whose head replayed a CUDA graph."""
    from ..model.backbone import backbone
    from ..model.head import heads
    sync = cp.cuda.Device().synchronize
    rows = {"backbone_ms": [], "head_ms": [], "head_launch_ms": []}
    replays, tokens = 0, []
    for i, records in enumerate(state_series(lens, ops.graphs.bucket, reps + 1, params.text.vocab_size, rng)):
        ids, cu, pos = _packed(records)
        qs = [r.questions for r in records]
        launched = ops.head_graphs.launches
        sync()
        t0 = time.perf_counter()
        hs, _ = backbone(ops, params, ids, cu, pos, check=False)
        sync()
        t1 = time.perf_counter()
        heads(ops, params, hs, ids, cu, qs)
        t2 = time.perf_counter()
        ops.check_watched()
        sync()
        t3 = time.perf_counter()
        for key, v in (("backbone_ms", t1 - t0), ("head_ms", t3 - t1), ("head_launch_ms", t2 - t1)):
            rows[key].append(v * 1e3)
        if i:                                      # the first run is a warm-up
            tokens.append(len(ids))
            replays += ops.head_graphs.launches - launched
    return {**{k: statistics.median(v[1:]) for k, v in rows.items()}, "head_graph_replays": replays,
            "series_tokens": tokens}


def route_counts(seen: dict) -> dict:
    """{route: GEMM shapes that took it} from ``CudaOps.gemm_routes``'s {shape key: route}, most used first: what
    the JSON and the report say of one case's GEMMs (e.g. {"wmma": 9, "rows": 4}: no cuBLAS)."""
    counts = Counter(route.value for route in seen.values())
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _routes_text(counts: dict) -> str:
    if not counts:
        return "GEMM routes unseen (CUDA graph replayed)"
    return "GEMM " + ", ".join(f"{p} {n}" for p, n in counts.items()) + " shapes"


def measure(cp, ops, label, T, run, reps):
    """One case: warm-up, one untimed forward for the memory figures (see ``text_cases``), then ``reps`` timed
    ones. The GEMM route of each shape is recorded over the two untimed runs (the eager first run, or a graph's
    capture). Printed, and returned as the JSON row."""
    pool = cp.get_default_memory_pool()
    with ops.gemm_routes() as seen:
        run()                               # warm-up: compiles, autotunes the GEMM shapes
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        base = pool.used_bytes()            # the weights (and whatever else outlives a forward)
        dev0 = _device_used(cp)
        with PeakInUse(cp) as pk:           # one untimed forward for the memory figures
            run()
            cp.cuda.Device().synchronize()
    routes = route_counts(seen)
    peak = pk.peak - base
    reserved = pool.total_bytes() - base
    dev = _device_used(cp) - dev0
    ts = []
    graphs = [g for g in (ops.graphs, ops.tower_graphs, ops.head_graphs) if g is not None]
    l0 = sum(g.launches for g in graphs)
    for _ in range(reps if T <= 8192 else max(1, reps - 1)):
        t0 = time.perf_counter()
        run()
        cp.cuda.Device().synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(ts)
    graphed = sum(g.launches for g in graphs) > l0
    print(f"  clefcore {label:16s} {ms:9.1f} ms  {T / ms * 1e3:9.0f} tok/s {'graph' if graphed else 'eager'}  "
          f"(runs {spread(ts)})  "
          f"beyond weights: peak in use "
          f"{peak / 2 ** 30:.2f} GiB, pool reserved {reserved / 2 ** 30:.2f} GiB, device {dev / 2 ** 30:.2f} GiB; "
          f"{_routes_text(routes)}")
    pool.free_all_blocks()
    return dict(case=label, tokens=T, ms=ms, runs_ms=ts, tok_s=T / ms * 1e3, gemm_routes=routes,
                token_block=ops.token_block,
                cuda_graph=graphed, graph_pools_gib=sum(g.nbytes() for g in graphs) / 2 ** 30,
                peak_in_use_gib=peak / 2 ** 30, pool_reserved_gib=reserved / 2 ** 30, device_gib=dev / 2 ** 30)


def text_cases(cp, ops, params, lengths, packed, reps, split_upto=0):
    """Times per case and GPU memory beyond the weights, three ways (GiB):
    peak_in_use: high-water of the CuPy default pool's in-use bytes during one untimed forward (after the
        warm-up), minus the in-use bytes before it (the weights): what the forward needs at its worst moment;
    pool_reserved: the pool's total_bytes() after that forward (the pool was emptied of cached blocks just
        before it, and it never returns memory by itself, so this is its reservation high-water; fragmentation
        makes it >= peak_in_use);
    device: cudaMemGetInfo used-bytes growth over that forward (the pool plus anything else the driver or
        cuBLAS took)."""
    V = params.text.vocab_size
    rng, series_rng = np.random.default_rng(0), np.random.default_rng(1)
    cases = [(f"{L} tokens", [L]) for L in lengths]
    if packed:
        n, l_ = (int(v) for v in packed.split("x"))
        cases.append((f"{n}x{l_} packed", [l_] * n))
    res = []
    for label, lens in cases:
        ids = rng.integers(0, V, sum(lens))
        cuts = np.cumsum(lens)[:-1]
        records = [record(x) for x in np.split(ids, cuts)]
        res.append(measure(cp, ops, label, sum(lens), forward_run(ops, params, records), reps))
        if sum(lens) <= split_upto:
            res[-1]["breakdown"] = parts = breakdown(cp, ops, params, lens, reps, series_rng)
            times = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if isinstance(v, float))
            print(f"    {times}; head graph replays {parts['head_graph_replays']} of {len(parts['series_tokens'])} "
                  f"(same schema, {min(parts['series_tokens'])}..{max(parts['series_tokens'])} tokens)")
    return res
