"""clefcore: torch-free inference for Cloudflare's Clef-flash System One decisions.

    import clefcore
    engine = clefcore.load("path/to/clef-flash", device="cpu")   # or "cuda:0"; or a Hub id in the HF cache,
                                                                 # "Cloudflare/clef-flash"
    engine.decide({"model": "clef-flash", "state": "...", "questions": {...}})
"""

from .engine import Engine, Prepared, load
from .options import EngineOptions
from .errors import CheckpointError, ClefError, ContextLengthError, DeviceError, RequestError

__version__ = "0.2.0"
__all__ = ["load", "EngineOptions", "Engine", "Prepared", "ClefError", "RequestError", "ContextLengthError",
           "CheckpointError", "DeviceError", "__version__"]
