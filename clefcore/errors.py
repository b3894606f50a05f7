"""Every error clefcore raises on purpose.

Callers (the CLI, the server, embedding code) catch ``ClefError`` and map the subclasses to exit codes or
HTTP statuses; anything else escaping the engine is a bug.
"""

from __future__ import annotations


class ClefError(Exception):
    """Base class. ``type`` is the machine-readable error kind used in JSON error bodies."""

    type = "clef_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type}}

    def __reduce__(self):
        # Whole across the device process's pipe: Exception's own pickling keeps only ``args`` and would call a
        # subclass with keyword fields (field, limit, required) without them.
        return _restore, (type(self), self.message, dict(self.__dict__))


def _restore(cls: type, message: str, fields: dict) -> ClefError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


class RequestError(ClefError):
    """The client's request is wrong. ``field`` is a dotted path (``questions.team.criteria``) or ``""``
    for the body itself; ``limit`` describes the rule that was broken, when there is one."""

    type = "invalid_request_error"

    def __init__(self, message: str, field: str = "", limit: str | None = None):
        super().__init__(message)
        self.field = field
        self.limit = limit

    def to_json(self) -> dict:
        body = super().to_json()
        if self.field:
            body["error"]["field"] = self.field
        if self.limit is not None:
            body["error"]["limit"] = self.limit
        return body


class BodyTooLargeError(RequestError):
    """The body holds more than a request may (``limit``): the server answers 413."""

    type = "request_too_large"


class ContextLengthError(RequestError):
    """The fixed part of the prompt (everything but the state) does not fit ``context_length``."""

    type = "exceed_context_size_error"

    def __init__(self, message: str, required: int, maximum: int):
        super().__init__(message, field="questions", limit=f"{maximum} tokens")
        self.required = required
        self.maximum = maximum


class ImageTokensError(RequestError):
    """An image, or a request's images together, would become more placeholder tokens than the deployment's
    limit on image tokens (the vision tower's cost grows with their square): the server's 413."""

    type = "request_too_large"


class PromptTokensError(RequestError):
    """A prompt longer than the deployment takes: on top of the context length, a server bounds a prompt by what
    its device runs within the wait budget (attention grows with the square of the length): the server's 413."""

    type = "request_too_large"


class CheckpointError(ClefError):
    """A model directory is missing a file, a tensor, or holds inconsistent values."""

    type = "checkpoint_error"


class DeviceError(ClefError):
    """The device failed a request: out of memory, a NaN/Inf/all-zero guard, a CUDA error."""

    type = "device_error"


class ArenaFull(DeviceError):
    """An arena (clefcore.pool.Arena) without overflow has no free piece as large as an allocation asks for."""


class GuardError(DeviceError):
    """A per-layer guard tripped: a layer's output holds NaN/Inf or is all zero. ``what`` names the layer and its
    tokens. In the fast precision the engine answers such a batch again on the range-safe exact path."""

    def __init__(self, message: str, what: str = ""):
        super().__init__(message)
        self.what = what
