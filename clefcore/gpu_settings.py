"""The CUDA backend's settings a user picks (``--gemm``, ``--token-block``, ``--graph-tokens``): their choices and
defaults, defined once here, below both the backend that runs them and clefcore/options.py's ``EngineOptions``
that parses them. Precision's names are clefcore/precision.py's; the kernel switches are clefcore/switches.py's."""

GEMM_CHOICES = ("auto", "wmma", "cublas")   # auto: a per-shape timing at load picks; else always that one
GEMM_DEFAULT = "auto"
TOKEN_BLOCK = 4096     # tokens per block of the layer-outer prefill (0: the whole stream)
GRAPH_TOKENS = 1024    # prompts (and fast-mode tower inputs) of up to this many tokens replay a CUDA graph (0: off)
