"""Clef-flash, the whole model: vision tower + Qwen3.5 hybrid backbone + joint schema head.

Written once against the backend interface (``clefcore.backends.interface.Backend``: ``backends.cpu.CpuOps`` is
the fp32 reference, ``backends.cuda.CudaOps`` the GPU one). ``ops.xp`` is the backend's array module, so the
reshapes and slices run unchanged on numpy and CuPy arrays. The math follows the specs: backbone =
qwen35-backbone.md §3, head = clef-head.md §5.3, tower = clef-images.md §8.

A forward, read top to bottom:

- ``params.py``: ``load_params`` converts the checkpoint into ``Params``, the backend's weights.
- ``vision.py``: ``tower`` turns an image's patches into the embeddings that stand in for its placeholder
  tokens in the token stream (``load_vision`` makes its weights).
- ``backbone.py``: ``backbone`` turns a packed token stream into final-norm hidden states: embeddings, every
  layer (``layer_block``: the mixer, gated DeltaNet or gated attention, then the MLP), the final norm.
- ``head.py``: ``heads`` turns those states into one logit vector per question (``readout`` picks what it reads
  of the stream, ``heads_from`` computes the rest).
- ``prefill.py``: ``ChunkedPrefill``, the same backbone over one long prompt a chunk at a time, keeping only
  what the head reads, so that other forwards run on the backend between two chunks.
"""
