"""clefcore's HTTP server (`clefcore serve`): System One over aiohttp, with a Cython-scheduled batcher,
Prometheus metrics, a playground page and Kubernetes-friendly probes. The entry points are
``app.add_arguments`` and ``app.run``."""
