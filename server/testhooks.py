"""Test-only fault injection, read from the environment once at start-up (docs/operations.md, "Test
hooks"). All are unset in production, where every hook is a no-op.

- ``CLEFCORE_TEST_FAIL_MARKER``: a request whose string ``state`` contains this text makes the device step
  raise ``DeviceError``, as an out-of-memory or NaN guard would (tests the 500 isolation).
- ``CLEFCORE_TEST_STICKY_MARKER``: a request whose string ``state`` contains this text breaks the device: that
  call and every later one (forwards, chunk steps, self-checks) raise ``DeviceError``, as after an illegal memory
  access, when every CUDA call of the process fails (tests telling a failed device from a failed request).
- ``CLEFCORE_TEST_BATCH_DELAY_S``: sleep this long before every packed forward (fills the queue on demand:
  429, deadlines, disconnects, draining).
- ``CLEFCORE_TEST_TOKEN_DELAY_S``: sleep this long per prompt token of every forward and chunk step: a device
  whose time grows with the work, so long prompts are measurably long on the tiny model (chunking, admission).
- ``CLEFCORE_TEST_LOAD_DELAY_S``: wait this long before loading the model (tests the 503 while loading).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TestHooks:
    __test__ = False  # not a pytest class, whatever the name says

    fail_marker: str | None
    batch_delay_s: float
    load_delay_s: float
    token_delay_s: float = 0.0
    sticky_marker: str | None = None

    @classmethod
    def from_environment(cls) -> "TestHooks":
        return cls(fail_marker=os.environ.get("CLEFCORE_TEST_FAIL_MARKER") or None,
                   batch_delay_s=float(os.environ.get("CLEFCORE_TEST_BATCH_DELAY_S") or 0),
                   load_delay_s=float(os.environ.get("CLEFCORE_TEST_LOAD_DELAY_S") or 0),
                   token_delay_s=float(os.environ.get("CLEFCORE_TEST_TOKEN_DELAY_S") or 0),
                   sticky_marker=os.environ.get("CLEFCORE_TEST_STICKY_MARKER") or None)
