"""``Backend``: what the model, the vision tower and the engine need from a backend, written down once.

Two implementations: ``clefcore.backends.cpu.CpuOps`` (fp32 numpy: ground truth, its ops every kernel's
reference) and ``clefcore.backends.cuda.CudaOps`` (one GPU). ``clefcore.model`` (the vision tower included) and
``clefcore.engine`` call only what is listed here, under these names and parameter names, and never probe a
backend for anything else (tests/test_backend_interface.py holds both backends to it). A new op starts here: its
numpy reference in cpu.py (a function, and the ``CpuOps`` method of that name that runs it), then its kernel
in cuda/, its method in the op object of its family (clefcore/backends/cuda/, e.g. ``Norms`` in norms.py) and
the ``CudaOps`` method that calls it.

Activations are ``[tokens, ...]`` row-major arrays of the backend's array module (``xp``); several sequences may
be packed into one token stream, described by ``cu_seqlens`` (sequence starts plus the total, like
``[0, 300, 512]``). Weights are whatever ``weight`` and ``table`` made of a checkpoint tensor.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol, runtime_checkable

from ..precision import Plan

Array = Any     # numpy.ndarray on the CPU, cupy.ndarray on a GPU


class Graphs(Protocol):
    """Replayed CUDA graphs (clefcore.backends.cuda.graphs.GraphCache), as the model calls them."""

    def padded_length(self, T: int, n_seqs: int) -> int | None:
        """Tokens to pad a single-sequence prompt to, or None when this forward runs eagerly."""

    def padded_tokens(self, T: int) -> int | None:
        """Tokens to pad a stream of T (packed or not) to, or None when it runs eagerly (the joint head)."""

    def fits(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` (unpadded: the vision tower) may replay a graph."""

    def run(self, key, fn: Callable, inputs: tuple, reads) -> Array:
        """``fn(*inputs)``, eagerly or from the graph of ``key``; ``reads``: every other array fn reads."""


@runtime_checkable
class Backend(Protocol):
    name: str                  # "cpu", "cuda"
    xp: Any                    # the array module: numpy or cupy
    mode: str                  # fast / exact (a GPU), fp32 (numpy): what the engine runs as, fixed at load
    plan: Plan                 # the next forward's kernel path and its row (precision.TABLE); fallback() switches it
    token_block: int           # the backbone's default token block (0 = the whole stream at once)
    graphs: Graphs | None      # short single-sequence prompts' graphs, or None (never replayed)
    tower_graphs: Graphs | None   # the vision tower's graphs, or None
    head_graphs: Graphs | None    # the joint head's graphs, one per question schema, or None (never replayed)
    falls_back: bool           # has a range-safe path to answer a batch again after a guard tripped

    # ---------------------------------------------------------------------------------- forward and guards
    def fallback(self) -> AbstractContextManager[None]:
        """The enclosed forward runs on the range-safe exact path (only where ``falls_back``)."""

    def reserve(self, worst_case: Callable[[], None]) -> int:
        """Reserve the device memory that ``worst_case`` (the largest forwards the caller will run, each between
        begin_forward and end_forward) needs, so that no later forward up to that size allocates; the bytes
        reserved (0: nothing to reserve, worst_case not run)."""

    def begin_forward(self) -> None:
        """Engine hook before a forward (drops guard records a failed forward left unread); the forward's
        buffers come from the reservation, where there is one."""

    def end_forward(self) -> None:
        ...

    def watch(self, x: Array, what: str) -> None:
        """Guard x (NaN, Inf, all zero); read by check_watched, or at once where nothing is deferred."""

    def check_watched(self) -> None:
        """Raise GuardError for the first watched array that failed its guard."""

    def memory_in_use(self) -> int:
        """Device bytes held (the server's device-memory gauge); 0 on the CPU."""

    def status(self) -> dict:
        """What /health and /metrics say of the backend beyond the engine's mode (the CPU: nothing)."""

    def fp16_summary(self) -> str | None:
        """One line for the end of a load when a weight did not fit the backend's storage, else None."""

    # ------------------------------------------------------------------------------------- data movement
    def asarray(self, x) -> Array:
        ...

    def to_host(self, x) -> Any:
        ...

    def weight(self, w) -> Array:
        """A checkpoint tensor (TensorRef or fp32 host array) in the backend's storage."""

    def table(self, ref) -> Any:
        """A vocabulary table (embeddings, LM head): the backend decides where it lives."""

    def gather_rows(self, table, ids) -> Array:
        ...

    def embed(self, table, ids) -> Array:
        ...

    # -------------------------------------------------------------------------------------------- backbone
    def rmsnorm(self, x, w, eps, gemm_input=False) -> Array:
        """``gemm_input``: the result is read only as the activation of weight GEMMs (``linear``, ``mlp``) with x's
        leading axis as their rows; the backend may then return it in the form those GEMMs take it (the CUDA
        backend's fast plan (precision.Row.fused_elementwise): fp16, the rounding the GEMM would make). The same
        for every op below that has the flag; numpy's result is fp32 either way."""

    def add_rmsnorm(self, x, delta, w, eps, gemm_input=False) -> tuple[Array, Array]:
        """(x + delta, rmsnorm(x + delta)); ``gemm_input`` applies to the norm (the sum stays fp32)."""

    def linear(self, x, w, b=None) -> Array:
        """x @ w^T (+ b)."""

    def mlp(self, x, w_gate, w_up, w_down) -> Array:
        """SwiGLU."""

    def rope_tables(self, positions, rotary_dim, theta) -> tuple[Array, Array]:
        ...

    def rotary(self, x, cos, sin) -> Array:
        ...

    def kv_cache(self, T, heads, D) -> Array:
        ...

    def kv_write(self, cache, t0, x) -> None:
        ...

    def attention(self, q, k, v, cu_seqlens, scale, q_offset=0) -> Array:
        """Causal GQA attention of query rows [q_offset, q_offset + n) of the packed stream."""

    def sigmoid_gate(self, o, gate, gemm_input=False) -> Array:
        ...

    def conv1d_silu(self, x, w, cu_seqlens, prev=None) -> Array:
        ...

    def l2norm(self, x, eps, scale=1.0) -> Array:
        ...

    def gdn_gates(self, a, b, a_log, dt_bias) -> tuple[Array, Array]:
        ...

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, state=None) -> Array:
        ...

    def gated_rmsnorm(self, x, z, w, eps, gemm_input=False) -> Array:
        ...

    # ------------------------------------------------------------------------------------------------ head
    def layernorm(self, x, w, b, eps=1e-5) -> Array:
        ...

    def gelu(self, x) -> Array:
        ...

    def sigmoid(self, x) -> Array:
        ...

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None) -> Array:
        """torch's MultiheadAttention. ``groups`` = (query ids, key ids), non-decreasing host ints: a query
        attends to the keys of its own group only, and each block of queries is scored against its groups' key
        range only. ``group_ids``: the same two id arrays as the backend's arrays, where the caller holds them
        there already (the joint head's index table: nothing is uploaded inside a CUDA graph's capture); None: the
        backend makes them from ``groups``. ``group_ids`` without ``groups``: the same mask, every block scored
        against every key, so that the launches depend on the shapes alone (the joint head's graphs)."""

    def span_means(self, x, starts, ends) -> Array:
        """The mean of x's rows [s, e) per span; ``starts``/``ends``: host ints or the backend's int arrays."""

    def normalize(self, x, eps) -> Array:
        ...

    def segment_softmax_sum(self, scores, values, owner, n_groups) -> Array:
        """Per group: the softmax of the scores of its rows, then the weighted sum of their values; ``owner``
        (each row's group, host ints or the backend's) non-decreasing: a group's rows are adjacent."""

    # --------------------------------------------------------------------------------------- vision tower
    def patch_rows(self, images) -> Array:
        ...

    def vision_attention(self, x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens) -> Array:
        ...

    def vision_mlp(self, x, w1, b1, w2, b2) -> Array:
        ...
