"""Command-line options and the configuration they build.

``EngineOptions``, the options of every command and program that loads an engine (``clefcore decide``/``demo``,
``serve``, ``verify`` and ``bench`` add its flags to their parsers and build it from the parsed values;
``clefcore.load`` takes it), and ``clefcore serve``'s own flags with ``ServiceConfig``, the configuration of the
server's ``Service`` (clefcore.server.service) that an embedding program builds from keyword arguments instead.
Both the CLI and the server import this module; it imports neither (the server is above it, see setup.cfg)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from . import gpu_settings, precision, switches
from .answers import CONFIDENCE_MODES
from .tokenize import SPLIT_REGEX

VALIDATIONS = ("cloudflare", "reference")
ON_OVERFLOW = ("truncate", "reject")
SPREADS = ("queue", "workers")        # --spread: how several devices share the load (queue: the default)
MAX_BODY_BYTES = 13 * 1024 * 1024   # --max-body-bytes' default
# --header-timeout's and --body-timeout's defaults, in seconds. nginx allows 60 s between two reads of a head or a
# body; these bound the whole of each (a client that trickles a byte at a time would pass nginx's). Real clients
# send a head in one write: 30 s still leaves room for TCP's retransmissions on a lossy link (1 + 2 + 4 + 8 s).
# A body of --max-body-bytes in 60 s needs 1.8 Mbit/s, and clients give up on an answer well before that
# (TypeSafe: 10 s).
HEADER_TIMEOUT = 30.0
BODY_TIMEOUT = 60.0
# --write-timeout's default: nginx's send_timeout. A client that takes none of its answer's bytes for this long
# is gone or hostile; a slow one that reads at all restarts the clock.
WRITE_TIMEOUT = 60.0


class HelpFormatter(argparse.HelpFormatter):
    """Every command's help: each option's help ends with its default, ``(default: VALUE)``, unless the help says
    it in words already (a default of None is worked out later, or means off: its help must say which) or the
    option is a flag or required (tests/test_cli_help.py holds every command to this)."""

    def _get_help_string(self, action: argparse.Action) -> str:   # argparse asks only for non-empty help
        text = action.help
        if ("default" in text or not action.option_strings or action.required or action.default is None
                or action.nargs == 0 or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def model_options(p: argparse.ArgumentParser, absent: str | None = None) -> None:
    """--model and --revision, for every command that loads a model; ``absent``: what the command loads without
    --model (None: --model is required)."""
    p.add_argument("--model", required=absent is None, default=None,
                   help="a model directory (release layout), or a Hugging Face Hub id such as Cloudflare/clef-flash, "
                        "read from the Hugging Face cache without the network ($HF_HUB_CACHE, else $HF_HOME/hub, "
                        "else ~/.cache/huggingface/hub; `clefcore download` fills it)"
                        + ("" if absent is None else f" (default: {absent})"))
    p.add_argument("--revision", default=None,
                   help="with a Hub id: the branch, tag or commit hash to load from the cache (default: the cache's "
                        "main ref, the commit the last download of main fetched)")


# --max-batch-tokens and --chunk-tokens at auto: the tokens of a step that takes --step-budget at the measured
# rate, within these bounds. The floor keeps an ordinary decision (the schema and a short state: a few hundred
# to a thousand tokens) in one piece, packed with others rather than chunked, and a slow device's steps from
# shrinking to where the cost of a forward itself dominates; the cap is what the device memory is reserved for
# at start, twice the 4096 that both limits were by default before they were sized by time.
STEP_FLOOR_TOKENS = 1024
STEP_CAP_TOKENS = 8192
STEP_BUDGET_S = 0.15   # ~4.2k tokens at the H100's ~28k prompt tokens per second of device time


def device_list(text: str) -> tuple[str, ...]:
    """The devices a --device value names, in order ("cuda:0, cuda:1" -> ("cuda:0", "cuda:1"))."""
    return tuple(d.strip() for d in text.split(",") if d.strip())


# --min-queue-wait's default: a burst of short requests is queued while its expected wait is within this (a
# second refused bursts that the device clears in two), and a short request admitted is still answered well
# within the 10 s that clients such as TypeSafe's SDKs wait.
MIN_QUEUE_WAIT = 5.0
DEFAULT_CONTEXT_LENGTH = 16384   # the reference's prompt limit: load()'s, decide's and demo's default
SERVE_CONTEXT_LENGTH = 24576     # what Cloudflare serves: clefcore serve's default
REGEXES = tuple(SPLIT_REGEX)


@dataclass(frozen=True)
class EngineOptions:
    """How an engine is loaded, whatever command or program loads it: ``clefcore.load(path, device, options)``,
    decide, demo, serve (``ServiceConfig.engine``, sent to the device process as it is), and the GPU part for
    verify and bench. A new engine option is a field here, with its default, its check in ``__post_init__`` and
    its flag in ``add_flags``. A value out of range raises ValueError naming the field and the limit.

    The GPU fields are None unless given: the CUDA backend's defaults apply (clefcore/gpu_settings.py,
    clefcore/precision.py), and on the CPU a given one is refused rather than ignored (``engine.backend_for``)."""

    context_length: int = DEFAULT_CONTEXT_LENGTH   # prompt tokens at most; a longer state is cut to fit
    validation: str = "cloudflare"                 # VALIDATIONS: the request rules
    confidence: str = "cloudflare"                 # CONFIDENCE_MODES: the confidence formula
    regex: str | None = None                       # REGEXES: force the tokenizer's split regex; None: the file's
    images: bool = True                            # False: the vision tower is left unloaded, images refused
    precision: str | None = None                   # precision.CHOICES
    gemm: str | None = None                        # gpu_settings.GEMM_CHOICES
    token_block: int | None = None                 # >= 0
    graph_tokens: int | None = None                # >= 0
    kernels: str | None = None                     # kernel switches (clefcore/switches.py); None: the environment
    ptx70: bool | None = None                      # True: the kernels' compute_70 PTX (the Volta code)

    GPU: ClassVar[tuple[str, ...]] = ("precision", "gemm", "token_block", "graph_tokens", "kernels", "ptx70")

    def __post_init__(self) -> None:
        if not self.context_length > 0:
            raise ValueError(f"context_length must be > 0, got {self.context_length}")
        for name, allowed in (("validation", VALIDATIONS), ("confidence", CONFIDENCE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name, allowed in (("regex", REGEXES), ("precision", precision.CHOICES),
                              ("gemm", gpu_settings.GEMM_CHOICES)):
            if getattr(self, name) not in (None, *allowed):
                raise ValueError(f"{name} must be one of {', '.join(allowed)} or None, got {getattr(self, name)!r}")
        for name in ("token_block", "graph_tokens"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 or None, got {getattr(self, name)}")
        if self.kernels:
            switches.parse(self.kernels)

    def gpu(self) -> dict:
        """The GPU options given (not None), as ``CudaOps``' keyword arguments."""
        return {name: getattr(self, name) for name in self.GPU if getattr(self, name) is not None}

    def add_flags(self, parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
        """The flags of the fields ``names`` (default: all), with this instance's values as their defaults."""
        wanted = set(names or (f.name for f in fields(self)))
        flags = {
            "context_length": (("--context-length",), dict(
                type=_positive(int), help="maximum prompt tokens; a longer state is cut to fit, or refused with "
                                          "serve's --on-overflow reject")),
            "validation": (("--validation",), dict(
                choices=VALIDATIONS, help="request rules: Cloudflare's limits, or the reference code's lenient ones")),
            "confidence": (("--confidence",), dict(
                choices=CONFIDENCE_MODES,
                help="confidence formula: cloudflare (Gini form, as hosted Clef) or another client's")),
            "regex": (("--regex",), dict(
                choices=REGEXES, help="force the tokenizer's split regex (default: the one in tokenizer.json)")),
            "images": (("--no-images",), dict(
                action="store_false",
                help="text only: leave the vision tower (model.visual.*) unloaded, about 0.9 GB of GPU memory on "
                     "Clef-flash; requests with images are then refused (422, field images)")),
            "precision": (("--precision",), dict(
                choices=precision.CHOICES,
                help=f"GPU precision: fast (default; each activation rounded once to fp16, fp32 accumulation; a "
                     f"batch whose per-layer guard trips runs again exactly, counted in /metrics) or exact "
                     f"(fp32-grade products: split, or split8 where fp8 tensor cores exist). The kernel paths "
                     f"{', '.join(precision.KERNEL_PATHS)} may be named directly")),
            "gemm": (("--gemm",), dict(
                choices=gpu_settings.GEMM_CHOICES,
                help="GPU GEMM kernels: auto (default; a short per-shape timing at load picks the faster, "
                     "logged), or always clefcore's wmma kernels or always cuBLAS (to rule one out)")),
            "token_block": (("--token-block",), dict(
                type=_non_negative(int),
                help=f"GPU prefill block in tokens (default {gpu_settings.TOKEN_BLOCK}; smaller = less memory, "
                     f"0 = whole prompt)")),
            "graph_tokens": (("--graph-tokens",), dict(
                type=_non_negative(int),
                help=f"GPU: prompts of up to this many tokens, and the vision tower (fast mode) over images of up "
                     f"to this many image tokens, replay a CUDA graph (default {gpu_settings.GRAPH_TOKENS}; "
                     f"0 = off); each cached graph holds its own activations (at most 4 graphs)")),
            "kernels": (("--kernels",), dict(
                type=_kernels, metavar="NAME[=on|off],...",
                help="GPU kernel switches (default: each switch's environment variable, else its default): "
                     + switches.describe().replace("%", "%%"))),
            "ptx70": (("--ptx70",), dict(
                action="store_const", const=True,
                help="GPU: run the kernels' compute_70 PTX (the V100's code, compiled by the driver) instead of "
                     "code built for this GPU, to run the Volta path on a newer one (the PTX is built by "
                     "clefcore.backends.cuda.compile.ptx70_path)")),
        }
        for f in fields(self):
            if f.name in wanted:
                strings, kw = flags[f.name]
                parser.add_argument(*strings, dest=f.name, default=getattr(self, f.name), **kw)
        if "context_length" in wanted:   # the flag's old name, still accepted from existing scripts
            parser.add_argument("--max-length", dest="context_length", type=_positive(int),
                                action=_Deprecated, new="--context-length", default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineOptions":
        """The options in parsed flags; a field whose flag the command does not have keeps its default."""
        given = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})


class _Deprecated(argparse.Action):
    """A flag's old name: sets the field as the ``new`` flag does, and says on stderr to use that."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stderr.write(f"{parser.prog}: warning: {option_string} is deprecated, use {self.new}\n")
        setattr(namespace, self.dest, values)


def _kernels(text: str) -> str:
    try:
        switches.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# --- clefcore serve --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServiceConfig:
    """How the server's Service loads and schedules the model. Each field but ``admission`` is the ``clefcore
    serve`` flag of the same name (``--max-queue``: ``max_queue``), and its default is the flag's; ``engine``
    holds the engine's flags (``--context-length``: ``engine.context_length``). A value out of range raises
    ValueError naming the field and the limit, as the flag's parser would refuse it."""

    model: str                              # a checkpoint directory, or a Hub id in the Hugging Face cache
    revision: str | None = None             # a Hub id's branch, tag or commit; None: the cache's main ref
    device: str = "cpu"                     # cpu, cuda:N, or several, comma-separated: one device process each
    engine: EngineOptions = EngineOptions(context_length=SERVE_CONTEXT_LENGTH)   # the engine's flags
    on_overflow: str = "truncate"           # ON_OVERFLOW: an over-long state is cut, or the request refused
    max_batch_tokens: int | None = None     # None: auto (step_budget at the measured rate)
    max_batch_requests: int = 32
    max_queue: int = 256
    request_timeout: float = 30.0
    max_queue_wait: float | None = None     # None: half of request_timeout (wait_budget)
    min_queue_wait: float | None = None     # None: MIN_QUEUE_WAIT, or the wait budget if smaller
    chunk_tokens: int | None = None         # None: auto, as max_batch_tokens; 0: never chunk
    step_budget: float = STEP_BUDGET_S      # seconds of device time an auto-sized step is cut to
    age_rate: float | None = None           # None: a third of the measured device rate; math.inf: first in,
                                            # first out
    max_image_tokens: int | None = None     # image tokens one image may become; None: auto (its vision tower
                                            # within one auto-sized step at the measured cost)
    max_request_image_tokens: int | None = None   # a request's images together; None: auto (MAX_IMAGES images at
                                                  # max_image_tokens)
    max_prompt_tokens: int | None = None    # prompt tokens at most, 413 above; None: auto (the longest prompt whose
                                            # run fits the longest wait budget at the cost measured at start)
    stall_timeout: float = 30.0             # a device call past max(this, 4x its expected time) is stalled
    device_grace: float = 60.0              # a device stalled or faulted this long is given up: the service fails
    first_lane: int = 0                     # the busy counter's lane of the first device: a --spread workers
                                            # worker's place in --device (set by the supervisor)
    # Not a flag: a library caller's own admission policy, a callable that builds it from the budgets
    # (server/admission.py: PolicyFactory, AdmissionPolicy); None: the shipped one, admission by cost.
    admission: Any = field(default=None, metadata={"flag": False})

    def __post_init__(self) -> None:
        for name in ("max_batch_requests", "max_queue", "request_timeout",
                     "step_budget", "stall_timeout", "device_grace"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_batch_tokens is not None and not self.max_batch_tokens > 0:
            raise ValueError(f"max_batch_tokens must be > 0 or None (auto), got {self.max_batch_tokens}")
        for name in ("max_queue_wait", "min_queue_wait"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        if not self.devices:
            raise ValueError(f"device must name at least one device (cpu, cuda:N), got {self.device!r}")
        for name in ("max_image_tokens", "max_request_image_tokens", "max_prompt_tokens"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 or None (auto), got {getattr(self, name)}")
        if self.chunk_tokens is not None and self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0 or None (auto), got {self.chunk_tokens}")
        if self.age_rate is not None and not self.age_rate > 0:
            raise ValueError(f"age_rate must be > 0 tokens/s, inf or None, got {self.age_rate}")
        if self.admission is not None and not callable(self.admission):
            raise ValueError(f"admission must be a callable that builds the admission policy from the budgets, "
                             f"or None, got {self.admission!r}")
        if self.on_overflow not in ON_OVERFLOW:
            raise ValueError(f"on_overflow must be one of {', '.join(ON_OVERFLOW)}, got {self.on_overflow!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServiceConfig":
        """The config in ``clefcore serve``'s parsed flags (the rest of them are the HTTP server's)."""
        return cls(engine=EngineOptions.from_args(args),
                   **{f.name: getattr(args, f.name) for f in fields(cls)
                      if f.name != "engine" and f.metadata.get("flag", True)})

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices ``device`` names, in order: the Service runs one device process (a lane) on each."""
        return device_list(self.device)

    @property
    def reserve_limits(self) -> dict:
        """``Engine.reserve``'s limits: the largest batch and chunk these settings can ever run, so an auto size
        counts at its cap (STEP_CAP_TOKENS)."""
        return dict(batch_tokens=STEP_CAP_TOKENS if self.max_batch_tokens is None else self.max_batch_tokens,
                    batch_requests=self.max_batch_requests,
                    chunk_tokens=STEP_CAP_TOKENS if self.chunk_tokens is None else self.chunk_tokens)

    @property
    def wait_budget(self) -> float:
        """Seconds of expected wait a request of context_length tokens may be admitted into: half the timeout
        leaves the other half for the estimate's error."""
        return self.max_queue_wait if self.max_queue_wait is not None else self.request_timeout / 2

    @property
    def min_wait_budget(self) -> float:
        """Seconds of expected wait any request may be admitted into, however short (``min_queue_wait``; by
        default MIN_QUEUE_WAIT, or the wait budget if that is smaller)."""
        return self.min_queue_wait if self.min_queue_wait is not None else min(MIN_QUEUE_WAIT, self.wait_budget)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _or_auto(kind):
    """A flag's parser that reads ``auto`` as None (sized as the service runs) and anything else with ``kind``."""
    def parse(text: str):
        return None if text.strip().lower() == "auto" else kind(text)
    parse.__name__ = kind.__name__ + " or auto"
    return parse


def _api_key(text: str) -> str:
    # A Secret that exists but holds an empty key must not serve without one: fail closed, as a missing one does.
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (from --api-key or $CLEFCORE_API_KEY): an empty key would "
                                         "turn authentication off; unset it to serve without a key")
    return text


def _age_rate(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of tokens/s, inf or auto, got {text}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 tokens/s, inf or auto, got {text}")
    return value


def serve_options(parser: argparse.ArgumentParser) -> None:
    """``clefcore serve``'s flags: ServiceConfig's (with its defaults) and the HTTP server's."""
    d = ServiceConfig(model="")
    model_options(parser)
    parser.add_argument("--device", default=d.device,
                        help="cpu, cuda:N, or a comma-separated list of devices, spread over as --spread says")
    parser.add_argument("--workers", type=int, default=0,
                        help="with --device cuda: serve on cuda:0..N-1, spread over as --spread says (0: off)")
    parser.add_argument("--spread", choices=SPREADS, default=SPREADS[0],
                        help="several devices: queue (one server process, one admission and one queue that "
                             "every device takes its next batch from whenever it is free, so no device idles "
                             "while another has work, whatever connections the clients keep) or workers (one "
                             "full server process per device on one port with SO_REUSEPORT: the kernel spreads "
                             "connections, not requests, and each worker admits by its own queue; processes "
                             "that share nothing)")
    # not flags: the workers' supervisor sets them for each worker it starts (server/workers.py)
    parser.set_defaults(reuse_port=False, first_lane=d.first_lane)
    d.engine.add_flags(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="listen address; 0.0.0.0 in a container")
    parser.add_argument("--port", type=int, default=8080,
                        help="listen port; 0 picks a free one and logs it")
    parser.add_argument("--on-overflow", default=d.on_overflow, choices=ON_OVERFLOW,
                        help="over-long state: cut its tail like the reference, or answer 400")
    parser.add_argument("--max-body-bytes", type=_positive(int), default=MAX_BODY_BYTES,
                        help="largest request body accepted in bytes, 413 above")
    parser.add_argument("--header-timeout", type=_positive(float), default=HEADER_TIMEOUT,
                        help="seconds a connection may take to send a request's line and headers, counted from "
                             "its opening or from the first byte after the previous request; then it is closed, "
                             "with 408 if part of them came")
    parser.add_argument("--body-timeout", type=_positive(float), default=BODY_TIMEOUT,
                        help="seconds from a request's headers to the end of its body; then 408 and the "
                             "connection is closed")
    parser.add_argument("--write-timeout", type=_positive(float), default=WRITE_TIMEOUT,
                        help="seconds a connection may leave its answers unread once the server's send buffers "
                             "for it are full; then it is closed and what waits for it is dropped")
    auto = (f"auto: the tokens of a step of --step-budget at the device's measured rate, kept current as it "
            f"serves, between {STEP_FLOOR_TOKENS} and {STEP_CAP_TOKENS} (the device memory is reserved for "
            f"{STEP_CAP_TOKENS})")
    parser.add_argument("--max-batch-tokens", type=_or_auto(_positive(int)), default="auto",
                        help=f"token budget of one packed forward: a number, or {auto}")
    parser.add_argument("--max-batch-requests", type=_positive(int), default=d.max_batch_requests,
                        help="requests in one packed forward")
    parser.add_argument("--max-queue", type=_positive(int), default=d.max_queue,
                        help="queued requests before answering 429")
    parser.add_argument("--request-timeout", type=_positive(float), default=d.request_timeout,
                        help="seconds a request may wait for its answer, 503 after")
    parser.add_argument("--max-queue-wait", type=_positive(float), default=d.max_queue_wait,
                        help="the wait a request of --context-length tokens tolerates, shorter ones in "
                             "proportion: a request is admitted while the work that runs before it plus its "
                             "own (tokens / measured device rate) fits, else 429 (default: half of "
                             "--request-timeout)")
    parser.add_argument("--min-queue-wait", type=_positive(float), default=d.min_queue_wait,
                        help="the wait any request tolerates, however short it is; never less than one "
                             f"device step, one chunk and its own run (default: {MIN_QUEUE_WAIT:g}, or "
                             f"--max-queue-wait if smaller; a smaller value refuses short requests sooner under "
                             f"load)")
    parser.add_argument("--chunk-tokens", type=_or_auto(_non_negative(int)), default="auto",
                        help="run prompts longer than this in chunks of this many tokens, between batches of "
                             f"short ones: a number, 0 (never), or {auto}")
    parser.add_argument("--step-budget", type=_positive(float), default=d.step_budget,
                        help="seconds of device time that an auto-sized step (--max-batch-tokens, "
                             "--chunk-tokens) takes at the measured rate: about what a short request waits for "
                             "the step ahead of it")
    parser.add_argument("--age-rate", type=_age_rate, default=d.age_rate,
                        help="scheduler aging, prompt tokens of priority per second waited: a number, inf "
                             "(first in, first out) or auto (default: auto, a third of the measured device rate: "
                             "a request is passed by shorter work for at most three times its own run time)")
    parser.add_argument("--max-image-tokens", type=_or_auto(_positive(int)), default="auto",
                        help="image tokens one image may become once resized within the model's processor "
                             "bounds (1,024 pixels each), 413 above: a number, or auto: the largest image whose "
                             "vision tower takes at most one step of --step-budget at the device's cost, measured "
                             "at start (the tower's time grows with the square of the image's pixels)")
    parser.add_argument("--max-request-image-tokens", type=_or_auto(_positive(int)), default="auto",
                        help="image tokens a request's images may become together, 413 above: a number, or auto "
                             "(four images at --max-image-tokens)")
    parser.add_argument("--max-prompt-tokens", type=_or_auto(_positive(int)), default="auto",
                        help="prompt tokens a request may have once cut to --context-length, 413 above: a number, "
                             "or auto: the longest prompt the device runs within --max-queue-wait (or "
                             "--min-queue-wait if larger) at the cost "
                             "measured at start (attention's time grows with the square of a prompt's length)")
    parser.add_argument("--stall-timeout", type=_positive(float), default=d.stall_timeout,
                        help="seconds a call on the device may run, or 4x its expected time (its tokens and its "
                             "images' vision towers, at their cost's ceiling, at the measured rate) if longer, "
                             "before the device counts as stalled: /health answers 503 and the queued requests 503 "
                             "until it answers again (default: %(default)s)")
    parser.add_argument("--device-grace", type=_positive(float), default=d.device_grace,
                        help="seconds a device may stay stalled, or keep failing its self-check, before the server "
                             "gives it up: its process is killed, its requests get 500 and the server exits 1 to be "
                             "restarted (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=_positive(float), default=30.0,
                        help="seconds to finish accepted requests after SIGTERM")
    parser.add_argument("--api-key", type=_api_key, default=os.environ.get("CLEFCORE_API_KEY"),
                        help="require this key on /v1 and /client/v4 routes (default: $CLEFCORE_API_KEY; "
                             "unset: no key is required; set but empty: refused, the server does not start)")
