"""server/logs.py's RefusalLog: 429s as one line a window, with their reasons, how many were refused only after
their body was read, and the slowest one's time from arrival."""

from __future__ import annotations

import asyncio
import json

from clefcore.server.logs import RefusalLog


def test_one_line_a_window_with_reasons_reads_and_the_slowest(capsys):
    async def run():
        refusals = RefusalLog(interval_s=0.05)
        refusals.note("queued_work", 0.002, read=False)
        refusals.note("queued_work", 0.240, read=True)
        refusals.note("evicted", 1.5, read=True)
        await asyncio.sleep(0.1)                      # the window closes: one line
        refusals.note("queue_full", 0.001, read=False)
        refusals.flush()                              # shutdown writes the open window at once

    asyncio.run(run())
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["refused", "refused"]
    first, second = lines
    assert first["count"] == 3 and first["reasons"] == {"queued_work": 2, "evicted": 1}
    assert first["after_reading"] == 2 and first["slowest_ms"] == 1500.0 and first["window_s"] >= 0.05
    # the counts start again with each window
    assert second["count"] == 1 and second["after_reading"] == 0 and second["slowest_ms"] == 1.0
