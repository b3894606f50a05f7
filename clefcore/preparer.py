"""The host side of a request: validate, decode its images, tokenize. Loads no weights.

The server runs this in its own process, on threads beside the event loop, while the model lives in the device
process (server/device_process.py); ``Engine`` holds one for the embedded path (``engine.decide``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import images
from .checkpoint import Checkpoint
from .config import read_json
from .encode import EncodedRecord, Encoder
from .errors import CheckpointError, ContextLengthError, ImageTokensError, RequestError
from .preprocess import FACTOR, PixelBounds, preprocess, smart_resize
from .tokenize import Tokenizer
from .validate import validate_request

NO_IMAGES = "images: this deployment was started without images (--no-images); send text only"
# The image processor class's own bounds (transformers' Qwen2VLImageProcessor), which the reference uses when the
# model's processor config gives neither ``size`` nor min_pixels / max_pixels.
PROCESSOR_DEFAULT_PIXELS = (56 * 56, 28 * 28 * 1280)


@dataclass(frozen=True)
class ImageLimits:
    """The most placeholder tokens one image (``per_image``) and a request's images together (``per_request``)
    may become once resized; None: only the processor's pixel bounds."""
    per_image: int | None = None
    per_request: int | None = None

    def __post_init__(self):
        for name in ("per_image", "per_request"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"image token limit {name} must be at least 1, got {value}")


@dataclass(frozen=True)
class Prepared:
    request: dict            # normalised by validate_request
    record: EncodedRecord

    @property
    def num_tokens(self) -> int:
        return int(len(self.record.input_ids))

    @property
    def images(self) -> tuple:
        """Its images, preprocessed (clefcore.preprocess.Pixels), in request order."""
        return self.record.images


class Preparer:
    def __init__(self, checkpoint: Checkpoint, context_length: int, validation: str, images_refused: str | None,
                 regex: str | None = None, image_limits: ImageLimits = ImageLimits()):
        """``images_refused``: None when the loaded model answers images, else the message an image request
        gets (only a load can tell: an incomplete tower is found while reading it). ``image_limits``: on top of
        the model's processor bounds (read from its processor config), the image tokens allowed."""
        self.context_length = context_length
        self.validation = validation
        self.images_refused = images_refused
        self.bounds = pixel_bounds(checkpoint.path)
        self.image_limits = image_limits
        self.encoder = Encoder(Tokenizer(checkpoint.tokenizer_path, regex=regex))

    def prepare(self, body, on_overflow: str = "truncate") -> Prepared:
        """Validate and encode. ``on_overflow="reject"`` refuses a request whose state would be cut."""
        request = validate_request(body, self.validation)
        pixels = ()
        if request.get("images"):
            if self.images_refused is not None:
                raise RequestError(self.images_refused, field="images")
            pixels = request_pixels(request, self.bounds, self.image_limits)   # on the host, before device work
        record = self.encoder.encode(request, self.context_length, pixels)
        if on_overflow == "reject" and record.state_truncated:
            need = len(record.input_ids) - (record.state_span[1] - record.state_span[0]) \
                + record.state_tokens_before_truncation
            more = "at least " if record.state_cut else ""   # the state's text past the cut was not counted
            raise ContextLengthError(f"prompt needs {more}{need} tokens (state {more}"
                                     f"{record.state_tokens_before_truncation}); maximum is {self.context_length}",
                                     required=need, maximum=self.context_length)
        return Prepared(request, record)


def request_pixels(request: dict, bounds: PixelBounds = PixelBounds(), limits: ImageLimits = ImageLimits()) -> tuple:
    """A validated request's images, decoded (bounded: clefcore/images.py) and preprocessed within ``bounds``, in
    request order. Each image's tokens are checked against ``limits`` from the size in its header, before its
    pixels are decompressed (the token count of a size and of its transpose are equal: EXIF rotation changes
    nothing)."""
    total = 0

    def admit(index: int, width: int, height: int) -> None:
        nonlocal total
        h, w = smart_resize(height, width, bounds)
        tokens = h * w // (FACTOR * FACTOR)
        total += tokens
        if limits.per_image is not None and tokens > limits.per_image:
            raise ImageTokensError(
                f"images[{index}]: a {width}x{height} image is resized to {w}x{h} and becomes {tokens} image "
                f"tokens; at most {limits.per_image} per image (send it smaller)",
                field=f"images[{index}]", limit=f"{limits.per_image} image tokens per image")
        if limits.per_request is not None and total > limits.per_request:
            raise ImageTokensError(
                f"images: the images up to images[{index}] become {total} image tokens; at most "
                f"{limits.per_request} per request",
                field="images", limit=f"{limits.per_request} image tokens per request")

    return tuple(preprocess(images.decode(data, i, partial(admit, i)), bounds)
                 for i, data in enumerate(request.get("images") or ()))


def pixel_bounds(directory: Path) -> PixelBounds:
    """The pixel bounds the reference's image processor reads from the model: processor_config.json's
    ``image_processor`` (or else preprocessor_config.json), its ``size`` {shortest_edge, longest_edge} with
    ``min_pixels`` / ``max_pixels`` replacing them where given, the processor class's defaults where neither is.
    A model that ships neither file gets the release's bounds. CheckpointError for values that are not positive
    integers with min <= max."""
    processor, preprocessor = directory / "processor_config.json", directory / "preprocessor_config.json"
    nested = read_json(processor) if processor.is_file() else {}
    if isinstance(nested, dict) and isinstance(nested.get("image_processor"), dict):
        source, config = processor, nested["image_processor"]
    elif preprocessor.is_file():
        source, config = preprocessor, read_json(preprocessor)
    else:
        return PixelBounds()
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: the image processor's config must be a JSON object")
    low, high = PROCESSOR_DEFAULT_PIXELS
    size = config.get("size")
    if size is not None:
        if not isinstance(size, dict) or "shortest_edge" not in size or "longest_edge" not in size:
            raise CheckpointError(f"{source}: image processor size must hold shortest_edge and longest_edge")
        low, high = size["shortest_edge"], size["longest_edge"]
    # an override given as null is no override, as in the reference
    low = low if config.get("min_pixels") is None else config["min_pixels"]
    high = high if config.get("max_pixels") is None else config["max_pixels"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)):
        raise CheckpointError(f"{source}: image processor pixel bounds must be integers, got {low!r}, {high!r}")
    try:
        return PixelBounds(low, high)
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from None
