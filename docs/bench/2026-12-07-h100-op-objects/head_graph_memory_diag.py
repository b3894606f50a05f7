# The diagnostic behind head-graph-memory-diagnosis.txt: copy it into tests/ and run it on a GPU with
#   pytest -q -s -p no:cacheprovider tests/head_graph_memory_diag.py
# (test_head_graph_gpu's fixtures and helpers, at b401b5e). "beyond": the device memory in use (memGetInfo) less
# the head graphs' pools; A: three keys of the same shapes through a one-graph cache, so each capture drops the
# last graph; B: forty schemas, each larger than the one it drops, through the full cache; then collection, the
# upload memo, the staging buffers and the cache itself emptied. test_diag_arena_pools repeats B with each
# graph's memory one 8 MiB clefcore.pool.Arena, and checks every replay against the key's first (eager) run.
import gc

from test_head_graph_gpu import _head, _seeded, _stream, gpu  # noqa: F401


def test_diag(gpu):
    import cupy
    ops, p = gpu
    cache = ops.head_graphs
    rt = cupy.cuda.runtime
    dp = cupy.get_default_memory_pool()

    def used():
        dp.free_all_blocks()
        free, total = rt.memGetInfo()
        return (total - free) / 2 ** 20

    def alive(name):
        return sum(1 for o in gc.get_objects() if type(o).__name__ == name)

    def line(tag):
        u = used()
        nb = cache.nbytes() / 2 ** 20
        print("DIAG", tag, "total", round(u, 1), "beyond", round(u - nb, 1), "nbytes", round(nb, 1),
              "dp_used", round(dp.used_bytes() / 2 ** 20, 2), "uploads", len(ops.ctx.caches.uploads),
              "functions", len(ops.ctx.caches.functions), "graphs", len(cache._graphs),
              "Graph", alive("Graph"), "MemoryPool", alive("MemoryPool"), "captures", cache.captures, flush=True)

    def capture(k, L=700):
        s = _stream(ops, p, [(L, [k])])
        for _ in range(3):
            _head(ops, p, s)
    line("start")
    saved = cache.capacity
    cache.capacity = 1
    for i in range(12):
        capture((5, i % 3))      # three keys of the same shapes, one graph kept: every capture evicts the last
        line(f"A{i}")
    cache.capacity = saved
    for i in range(cache.capacity):
        capture((2 + i, 2))
    line("full")
    for i in range(30):
        capture((2 + i, 1))
        if i % 3 == 2:
            line(f"B{i}")
    gc.collect()
    line("gc")
    ops.ctx.caches.uploads.clear()
    line("uploads cleared")
    ops.ctx.staged.clear()
    line("staged cleared")
    cache._graphs.clear()
    gc.collect()
    line("cache emptied")


def test_diag_arena_pools(gpu):
    import cupy
    from clefcore.pool import Arena
    ops, p = gpu
    cache = ops.head_graphs
    cache._graphs.clear()
    gc.collect()
    rt = cupy.cuda.runtime
    dp = cupy.get_default_memory_pool()

    class ArenaPool:
        def __init__(self):
            self.arena = Arena(8 << 20, ops.ctx.device_id)

        def malloc(self, n):
            return self.arena.malloc(n)

        def total_bytes(self):
            return self.arena.capacity

    def used():
        dp.free_all_blocks()
        free, total = rt.memGetInfo()
        return (total - free) / 2 ** 20

    def line(tag):
        u = used()
        nb = cache.nbytes() / 2 ** 20
        print("DIAG-ARENA", tag, "total", round(u, 1), "beyond", round(u - nb, 1), "nbytes", round(nb, 1),
              "graphs", len(cache._graphs), "captures", cache.captures, flush=True)

    def capture(k):
        s = _stream(ops, p, [(700, [k])])
        want = None
        for _ in range(3):
            got = _head(ops, p, s)
            if want is None:
                want = got
            else:
                for a, b in zip(got, want):
                    for x, y in zip(a, b):
                        assert float(abs(x - y).max()) < 1e-5
    real = cupy.cuda.MemoryPool
    cupy.cuda.MemoryPool = ArenaPool
    try:
        line("start")
        for i in range(cache.capacity):
            capture((2 + i, 2))
        line("full")
        for i in range(40):
            capture((2 + i, 0))
            if i % 4 == 3:
                line(f"B{i}")
    finally:
        cupy.cuda.MemoryPool = real
