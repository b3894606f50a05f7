"""The host side of a request: validate, decode its images, tokenize. Loads no weights.

The server runs this in its own process, on threads beside the event loop, while the model lives in the device
process (server/device_process.py); ``Engine`` holds one for the embedded path (``engine.decide``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import images
from .checkpoint import Checkpoint
from .encode import EncodedRecord, Encoder
from .errors import ContextLengthError, RequestError
from .preprocess import preprocess
from .tokenize import Tokenizer
from .validate import validate_request

NO_IMAGES = "images: this deployment was started without images (--no-images); send text only"


@dataclass(frozen=True)
class Prepared:
    request: dict            # normalised by validate_request
    record: EncodedRecord

    @property
    def num_tokens(self) -> int:
        return int(len(self.record.input_ids))


class Preparer:
    def __init__(self, checkpoint: Checkpoint, context_length: int, validation: str, images_refused: str | None,
                 regex: str | None = None):
        """``images_refused``: None when the loaded model answers images, else the message an image request
        gets (only a load can tell: an incomplete tower is found while reading it)."""
        self.context_length = context_length
        self.validation = validation
        self.images_refused = images_refused
        self.encoder = Encoder(Tokenizer(checkpoint.tokenizer_path, regex=regex))

    def prepare(self, body, on_overflow: str = "truncate") -> Prepared:
        """Validate and encode. ``on_overflow="reject"`` refuses a request whose state would be cut."""
        request = validate_request(body, self.validation)
        pixels = ()
        if request.get("images"):
            if self.images_refused is not None:
                raise RequestError(self.images_refused, field="images")
            pixels = request_pixels(request)       # on the host, before any device work
        record = self.encoder.encode(request, self.context_length, pixels)
        if on_overflow == "reject" and record.state_truncated:
            need = len(record.input_ids) - (record.state_span[1] - record.state_span[0]) \
                + record.state_tokens_before_truncation
            more = "at least " if record.state_cut else ""   # the state's text past the cut was not counted
            raise ContextLengthError(f"prompt needs {more}{need} tokens (state {more}"
                                     f"{record.state_tokens_before_truncation}); maximum is {self.context_length}",
                                     required=need, maximum=self.context_length)
        return Prepared(request, record)


def request_pixels(request: dict) -> tuple:
    """A validated request's images, decoded (bounded: clefcore/images.py) and preprocessed, in request order."""
    return tuple(preprocess(images.decode(data, i)) for i, data in enumerate(request.get("images") or ()))
