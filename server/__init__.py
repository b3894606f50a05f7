"""clefcore's HTTP server (`clefcore serve`): System One over aiohttp, with a Cython-scheduled batcher,
Prometheus metrics, a playground page and Kubernetes-friendly probes. One module per job: the flags are
clefcore/options.py's; ``main`` starts the process (and ``workers`` one per GPU); ``service`` is the model's
lifecycle and request path as a library (``Service``); ``routes`` is the HTTP side (``build_app``, ``mount``)."""
