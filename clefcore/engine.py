"""The engine: one loaded model answering System One requests.

A request's path: ``prepare`` (parse check, validate, encode: host only) -> ``infer`` (pack several prepared
requests into one token stream, run the backbone once and the joint head once over the batch, map
logits to answers).
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import answers
from .backends.interface import Backend
from .checkpoint import Checkpoint
from .device import Device
from .encode import EncodedRecord
from .errors import ClefError, DeviceError, GuardError, RequestError
from .example_request import support_ticket
from .model import vision
from .model.backbone import backbone
from .model.head import head_rows, heads, heads_from
from .model.params import load_params
from .model.prefill import ChunkedPrefill
from .options import EngineOptions
from .preparer import NO_IMAGES, Prepared, Preparer

log = logging.getLogger("clefcore")


@dataclass(frozen=True)
class EngineStatus:
    """What a loaded engine runs as and what it has done so far (the server's /health, /metrics and logs)."""
    model_name: str
    device: str
    mode: str                      # fast / exact on a GPU (clefcore/precision.py); fp32 on the numpy path
    images_refused: str | None     # None: image requests are answered; else the message they get
    backend: dict                  # what the backend says of itself (Backend.status: on a GPU, cuBLAS or not)
    fallbacks: int                 # batches answered again on the range-safe exact path
    memory_in_use: int             # device bytes (0 on the CPU)


def backend_for(device: str, options: EngineOptions) -> Backend:
    """``"cpu"`` -> a CpuOps (numpy); ``"cuda"``/``"cuda:N"`` -> a CudaOps instance on GPU N, with the GPU options
    given."""
    parsed = Device.parse(device)
    gpu = options.gpu()
    if parsed.kind == "cpu":
        if gpu:
            raise ClefError(f"{', '.join(sorted(gpu))}: GPU-only options (device is 'cpu')")
        from .backends.cpu import CpuOps
        return CpuOps()
    from .backends.cuda import CudaOps
    return CudaOps(parsed.index, **gpu)


class Engine:
    def __init__(self, path: str | Path, device: str = "cpu", options: EngineOptions = EngineOptions(),
                 progress=None, revision: str | None = None):
        self.checkpoint = Checkpoint(path, revision)
        self.model_name = self.checkpoint.name
        self.device = device
        self.options = options
        self.confidence = options.confidence
        self.ops = backend_for(device, options)
        # "fast" / "exact" on a GPU (clefcore/precision.py); the numpy path is fp32 throughout
        self.mode = self.ops.mode
        self.fallbacks = 0       # batches answered again on the range-safe exact path after a guard tripped
        self.params = load_params(self.checkpoint, self.ops, progress=progress)
        if options.images:
            self.vision, self.images_refused = vision.attach(self.checkpoint, self.ops, self.params, progress)
        else:   # a text-only deployment leaves model.visual.* on disk (0.9 GB of GPU memory on the 9B)
            self.vision, self.images_refused = None, NO_IMAGES
        self.host = Preparer(self.checkpoint, options.context_length, options.validation, self.images_refused,
                             options.regex)
        summary = self.ops.fp16_summary()
        if summary:
            log.warning("%s", summary)

    # ------------------------------------------------------------------------------------------- host side
    def encode(self, body) -> EncodedRecord:
        """Token ids and spans of a request body (validated first)."""
        return self.prepare(body).record

    def prepare(self, body, on_overflow: str = "truncate") -> Prepared:
        """Validate and encode (clefcore/preparer.py); host only."""
        return self.host.prepare(body, on_overflow)

    # ----------------------------------------------------------------------------------------- device side
    def forward(self, records: list[EncodedRecord], keep_layers: bool = False):
        """One packed backbone pass over every record, then one joint-head pass over all of them.
        Returns (logits per record, final hidden states [T, H] on the device, per-layer streams or None).

        Never silently wrong: when a layer's guard trips (NaN, Inf or all zero: in the fast precision, a value
        beyond fp16's range), the batch runs again on the backend's range-safe exact path and is answered from
        there, counted in ``fallbacks`` and logged with the layer. Only a failure there too is a DeviceError."""
        try:
            return self._forward(records, keep_layers)
        except GuardError as first:
            if not self.ops.falls_back:
                raise
            self._count_fallback(first, len(records), sum(len(r.input_ids) for r in records))
            with self.ops.fallback():
                try:
                    return self._forward(records, keep_layers)
                except GuardError as again:
                    raise DeviceError(f"{again.message} (range-safe exact path, run after the {self.mode} "
                                      f"precision's guard tripped: {first.message})") from again

    def _count_fallback(self, first: GuardError, requests: int, tokens: int) -> None:
        self.fallbacks += 1
        log.warning("precision %s: %s; the batch (%d requests, %d tokens) runs again on the range-safe exact path",
                    self.mode, first.message, requests, tokens)

    def chunked(self, prepared: Prepared, chunk: int) -> "ChunkedRun":
        """A request answered in chunks of ``chunk`` prompt tokens (see ChunkedRun): the server interleaves the
        steps of a long prompt with batches of short ones."""
        return ChunkedRun(self, prepared, chunk)

    def reserve(self, batch_tokens: int, batch_requests: int, chunk_tokens: int = 0) -> int:
        """Reserve at once the device memory of the largest work a server with these limits gives this engine
        (Backend.reserve): a packed batch of ``batch_tokens`` over ``batch_requests`` prompts, a prompt of the
        longest length that runs whole, both while a prompt of ``context_length`` tokens is carried chunked (in
        chunks of ``chunk_tokens``; 0: never chunked), and the batch again on the range-safe path that a guard
        trip re-runs it on. Text only: the vision tower's activations are not included. Returns the bytes
        reserved (0 on the CPU); DeviceError, naming the limits, when they do not fit."""
        longest = self.host.context_length
        whole = min(longest, chunk_tokens) if 0 < chunk_tokens < longest else longest
        base = self.prepare(support_ticket())
        per = max(batch_tokens // batch_requests, base.num_tokens)
        packed = [padded(base, per).record] * max(1, min(batch_requests, batch_tokens // per))
        single = [padded(base, whole).record]

        def worst_case():
            run = ChunkedRun(self, padded(base, longest), chunk_tokens) if whole < longest else None
            while run is not None and run.tokens_left > chunk_tokens:
                run.step()
            self.forward(packed)     # a guard trip on the synthetic prompt re-runs it on the range-safe path
            self.forward(single)
            if self.ops.falls_back:  # a batch answered again after a guard trip: the range-safe path's buffers
                with self.ops.fallback():
                    self._forward(packed, False)
            if run is not None:
                run.step()
                run.logits()

        counted = self.fallbacks
        try:
            return self.ops.reserve(worst_case)
        except DeviceError as error:
            raise DeviceError(f"cannot reserve device memory for a {longest}-token context, batches of "
                              f"{batch_tokens} tokens over {batch_requests} requests and chunks of {chunk_tokens} "
                              f"tokens: {error.message}; lower --max-batch-tokens, --chunk-tokens, --context-length "
                              f"or --token-block") from error
        finally:
            self.fallbacks = counted    # the synthetic prompts' guard trips are no request's

    @contextmanager
    def on_device(self):
        """One forward's window (Backend.begin_forward / end_forward): with a reservation, its buffers come from
        it."""
        self.ops.begin_forward()
        try:
            yield
        finally:
            self.ops.end_forward()

    def _forward(self, records: list[EncodedRecord], keep_layers: bool):
        lengths = [len(r.input_ids) for r in records]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate([r.input_ids for r in records]).astype(np.int64)
        positions = packed_positions(records)
        ops = self.ops
        with self.on_device():
            rows, embeds = self.image_inputs(records)
            hs, layers = backbone(ops, self.params, ids, cu, positions, keep_layers=keep_layers, check=False,
                                  image_rows=rows, image_embeds=embeds)
            try:
                # the head is queued behind the backbone without waiting for its guard flags
                logits = heads(ops, self.params, hs, ids, cu, [r.questions for r in records])
            finally:
                ops.check_watched()   # the backbone's guard flags, read once; a bad layer fails the whole batch
        return logits, hs, layers

    def image_inputs(self, records: list[EncodedRecord]):
        """See the module's image_inputs; refuses when this engine does not answer images."""
        self.check_images(records)
        return image_inputs(self.ops, self.vision, records)

    def check_images(self, records: list[EncodedRecord]) -> None:
        """RequestError when a record has images and this engine does not answer them: prepare refuses these; a
        record made elsewhere must not run without them."""
        if any(r.images for r in records) and self.vision is None:
            raise RequestError(self.images_refused, field="images")

    def infer(self, prepared: list[Prepared]) -> list[dict]:
        if not prepared:
            return []
        logits, _, _ = self.forward([p.record for p in prepared])
        return [answers.response(p.request, p.record, z, self.confidence) for p, z in zip(prepared, logits)]

    # -------------------------------------------------------------------------------------------- shortcuts
    def decide(self, body) -> dict:
        return self.infer([self.prepare(body)])[0]

    def decide_many(self, bodies) -> list[dict]:
        return self.infer([self.prepare(b) for b in bodies])

    def self_check(self) -> dict:
        """Run the example request (clefcore/example_request.py); raise ClefError unless every answer is complete
        and well-formed."""
        body = support_ticket()
        out = self.decide(body)
        got = out.get("answers", {})
        if list(got) != list(body["questions"]):
            raise ClefError(f"self-check: answers for {list(got)}, expected {list(body['questions'])}")
        for qid, a in got.items():
            probs = list(a.get("probabilities", {}).values()) or [a["noul"]]
            if not all(0.0 <= p <= 1.0 for p in probs) or (len(probs) > 1 and abs(sum(probs) - 1) > 0.02):
                raise ClefError(f"self-check: question {qid}: implausible probabilities {probs}")
        return out

    def memory_in_use(self) -> int:
        return int(self.ops.memory_in_use())

    def status(self) -> EngineStatus:
        return EngineStatus(self.model_name, self.device, self.mode, self.images_refused, self.ops.status(),
                            self.fallbacks, self.memory_in_use())


def padded(prepared: Prepared, tokens: int) -> Prepared:
    """``prepared`` with its state lengthened to ``tokens`` tokens in all (its first state token repeated) and
    the questions' spans moved along: synthetic work of a chosen size (Engine.reserve)."""
    r = prepared.record
    extra = tokens - len(r.input_ids)
    if extra <= 0:
        return prepared
    s0, s1 = r.state_span
    ids = np.concatenate([r.input_ids[:s0], np.full(extra, r.input_ids[s0], r.input_ids.dtype), r.input_ids[s0:]])

    def moved(span):
        return (span[0] + extra, span[1] + extra) if span[0] >= s1 else span

    questions = tuple(replace(q, question_span=moved(q.question_span),
                              option_spans=tuple(moved(o) for o in q.option_spans)) for q in r.questions)
    return replace(prepared, record=replace(r, input_ids=ids, questions=questions, state_span=(s0, s1 + extra)))


def image_inputs(ops, vp: vision.VisionParams | None, records: list[EncodedRecord]):
    """The vision tower over every image of a packed batch at once (each image attends only to itself): (rows of
    the packed stream that are image pads, their embeddings [n, H]), or (None, None) without images."""
    if not any(r.images for r in records):
        return None, None
    return image_rows(records), tower_embeds(ops, vp, [p for r in records for p in r.images])


def tower_embeds(ops, vp: vision.VisionParams, images, replay: bool = True):
    """The vision tower over ``images`` (clefcore.preprocess.Pixels) in one call: their embeddings [n, H], in
    placeholder order (``replay``: as vision.tower's)."""
    patches = ops.patch_rows([p.image for p in images])       # made where the tower runs, from the uint8 pixels
    return vision.tower(ops, vp, patches, [p.grid_thw for p in images], replay=replay)


def image_rows(records: list[EncodedRecord]) -> np.ndarray:
    """The rows of the packed stream of ``records`` that are image pads, in placeholder order."""
    starts = np.concatenate([[0], np.cumsum([len(r.input_ids) for r in records])])
    rows = np.concatenate([np.arange(s, e) + starts[b] for b, r in enumerate(records) for s, e, _, _ in r.image_spans])
    return rows.astype(np.int64)


def packed_positions(records: list[EncodedRecord]) -> np.ndarray:
    """Positions of the packed stream: [T] for text-only batches (as always); [3, T] M-RoPE rows as soon as one
    record has images (a text-only record's three rows are equal, which is the 1-D rope exactly)."""
    if all(r.positions is None for r in records):
        return np.concatenate([np.arange(len(r.input_ids)) for r in records]).astype(np.int64)
    return np.concatenate([r.positions if r.positions is not None else np.tile(np.arange(len(r.input_ids)), (3, 1))
                           for r in records], axis=1).astype(np.int64)


def load(path: str | Path, device: str = "cpu", options: EngineOptions | None = None, *, progress=None,
         revision: str | None = None, max_length: int | None = None, **fields) -> Engine:
    """Load a checkpoint onto ``device`` ("cpu", "cuda", "cuda:N"): a directory in the release layout, or a Hub id
    (``Cloudflare/clef-flash``) found in the Hugging Face cache at ``revision=`` (default: the cache's main ref).
    ``options``: an EngineOptions (default: its defaults); keyword arguments named as its fields
    (``precision="exact"``) replace those fields. ``max_length``: ``context_length``'s old name, deprecated."""
    if max_length is not None:
        warnings.warn("load(max_length=) is deprecated, use context_length=", DeprecationWarning,
                      stacklevel=2)
        fields["context_length"] = max_length
    return Engine(path, device, replace(options or EngineOptions(), **fields), progress, revision)


class ChunkedRun:
    """One request's prefill as a sequence of ``step()`` calls of ``chunk`` tokens each (ChunkedPrefill),
    then ``response()``: the joint head over the whole prompt, once. Between steps the engine may run other
    forwards. A request with images first runs their vision tower: with the first chunk, or split, a block of
    images per step (``step(images=n)``), so that no step runs more than a block's tower. Guards are read after
    every step; a trip restarts the run on the range-safe exact path (counted and logged as in Engine.forward),
    a trip there too is a DeviceError. Answers equal the unchunked forward's up to fp rounding."""

    def __init__(self, engine: Engine, prepared: Prepared, chunk: int):
        self.engine, self.prepared, self.chunk = engine, prepared, int(chunk)
        engine.check_images([prepared.record])
        self.safe = False          # running on the range-safe exact path after a guard trip
        self._start()

    def _start(self) -> None:
        """From the beginning: no image through the tower yet, no chunk run."""
        self._embeds: list = []    # the tower's output per block of images run so far, in order
        self._towered = 0          # images through the tower
        self._prefill: ChunkedPrefill | None = None

    def _tower(self, images: int) -> None:
        """The vision tower over the next ``images`` images (on the device, inside a step)."""
        e, pending = self.engine, self.prepared.record.images[self._towered:self._towered + images]
        self._embeds.append(tower_embeds(e.ops, e.vision, pending))
        self._towered += len(pending)

    def _begin(self) -> ChunkedPrefill:
        """The chunked prefill, once every image is through the tower."""
        e, rec = self.engine, self.prepared.record
        rows = embeds = None
        if rec.images:
            rows = image_rows([rec])
            embeds = self._embeds[0] if len(self._embeds) == 1 else e.ops.xp.concatenate(self._embeds)
            self._embeds = []
        return ChunkedPrefill(e.ops, e.params, rec.input_ids, self.chunk,
                              head_rows([0, len(rec.input_ids)], [rec.questions]),
                              positions=rec.positions, image_rows=rows, image_embeds=embeds)

    @property
    def done(self) -> bool:
        return self._prefill is not None and self._prefill.done

    @property
    def images_left(self) -> int:
        """Images not yet through the vision tower."""
        return len(self.prepared.record.images) - self._towered

    @property
    def tokens_left(self) -> int:
        return len(self.prepared.record.input_ids) - (0 if self._prefill is None else self._prefill.t)

    def _context(self):
        return self.engine.ops.fallback() if self.safe else nullcontext()

    def step(self, tokens: int | None = None, images: int = 0) -> bool:
        """Run the next chunk (of ``tokens``, default the run's ``chunk``), the vision tower of the images not yet
        through it first; with ``images`` > 0 while images are left, only the tower of the next ``images``
        instead. True when the prefill is complete."""
        ops = self.engine.ops
        try:
            with self.engine.on_device(), self._context():
                if images > 0 and self.images_left:
                    self._tower(images)
                else:
                    if self.images_left:
                        self._tower(self.images_left)
                    if self._prefill is None:
                        self._prefill = self._begin()
                    self._prefill.step(tokens)
                ops.check_watched()
        except GuardError as first:
            if self.safe or not ops.falls_back:
                raise
            self.engine._count_fallback(first, 1, len(self.prepared.record.input_ids))
            self.safe = True
            self._start()
        return self.done

    def logits(self) -> list:
        """The head's logits per question (host fp32), after the last step."""
        if not self.done:
            raise RuntimeError(f"chunked prefill has {self.tokens_left} tokens left")
        e, rec = self.engine, self.prepared.record
        with e.on_device(), self._context():
            z = heads_from(e.ops, e.params, self._prefill.readout, rec.input_ids, self._prefill.cu,
                           [rec.questions])[0]
            e.ops.check_watched()
        return z

    def response(self) -> dict:
        return answers.response(self.prepared.request, self.prepared.record, self.logits(), self.engine.confidence)
