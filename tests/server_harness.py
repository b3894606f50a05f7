"""Start a real `clefcore serve` process on a loopback port with the tiny golden checkpoint on the CPU,
and talk to it over real HTTP. Shared by the tests/test_server*.py modules; and the stand-ins that the tests
of the batcher on a fake device share (the end of this file).

The server is started with ``--port 0``; its first JSON log line (``"event": "listening"``) names the port,
so parallel test runs never race for a port. Every stderr line is kept for assertions on the request log.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from clefcore.engine import EngineStatus
from clefcore.example_request import support_ticket
from clefcore.scheduler import Entry
from clefcore.server.admission import Budgets, LaneView, QueueView, Snapshot
from clefcore.server.batcher import Batcher
from clefcore.server.device_watch import DeviceWatch
from clefcore.server.metrics import Metrics

GOLDEN = Path(__file__).parent / "golden"
MODEL = GOLDEN / "model"

# The example request as golden/requests.jsonl records it, naming "clef": some tests rely on a body whose
# model differs from a route's clef-flash.
SUPPORT_TICKET = support_ticket(model="clef")


def short(n: int = 0) -> dict:
    """A one-question request of ~134 prompt tokens, numbered ``n``."""
    return {"model": "clef", "state": f"Checkout fails for customer {n}.",
            "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}}


def ticket(state: str, **changes) -> dict:
    """The support-ticket request with another state (different prompts, same answer shapes)."""
    body = json.loads(json.dumps(SUPPORT_TICKET))
    body["state"] = state
    body.update(changes)
    return body


class Server:
    def __init__(self, *args: str, env: dict | None = None, start_timeout: float = 60.0):
        self.args = list(args)
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.lines: list[str] = []
        self.port: int | None = None
        self._listening = threading.Event()
        # Outside the source tree, so `-m clefcore.cli` imports the installed package (with its compiled
        # scheduler), never the bare in-tree folder.
        self._cwd = tempfile.mkdtemp(prefix="clef-serve-")
        cmd = [sys.executable, "-m", "clefcore.cli", "serve", "--model", str(MODEL), "--port", "0",
               *self.args]
        self.proc = subprocess.Popen(cmd, cwd=self._cwd, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._listening.wait(start_timeout):
            self.kill()
            raise RuntimeError("server did not start listening:\n" + "\n".join(self.lines[-30:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.port is None:
                event = _json_or_none(line)
                if event and event.get("event") == "listening":
                    self.port = event["port"]
                    self._listening.set()

    # --- lifecycle -------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 60.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n" + "\n".join(self.lines[-30:]))
            try:
                if self.get("/health").status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()     # a caller that chains wait_ready() inside `with` gets no __exit__ to do it
        raise RuntimeError("server never became ready:\n" + "\n".join(self.lines[-30:]))

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Wait for the process to end and for its last log lines to be read."""
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def rss_bytes(self) -> int:
        """The server's resident memory and its device process's (where the model lives), together."""
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return sum(_rss(p) for p in [pid, *map(int, children)])

    def device_pids(self) -> list[int]:
        """The pids of the server's device processes (the model's own processes, server/device_process.py)."""
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        # multiprocessing's resource tracker is a child too; device processes are the ones spawned to serve
        return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]

    def device_pid(self) -> int:
        """The pid of the server's one device process."""
        (device,) = self.device_pids()
        return device

    def events(self, name: str) -> list[dict]:
        return [e for e in map(_json_or_none, list(self.lines)) if e and e.get("event") == name]

    def wait_for_events(self, name: str, predicate, timeout: float = 5.0) -> list[dict]:
        """The server writes a log line before its response, but our reader thread may see it a moment
        after the response arrives: poll."""
        deadline = time.monotonic() + timeout
        while not predicate(self.events(name)) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.events(name)

    # --- HTTP ------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict | None = None, timeout: float = 60.0) -> "Reply":
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, dict):
                body = json.dumps(body)
            if isinstance(body, str):
                body = body.encode()
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def get(self, path: str, **kw) -> "Reply":
        return self.request("GET", path, **kw)

    def post(self, path: str, body, headers: dict | None = None, **kw) -> "Reply":
        headers = {"Content-Type": "application/json", **(headers or {})}
        return self.request("POST", path, body, headers, **kw)

    def decide(self, body, **kw) -> "Reply":
        return self.post("/v1/systemone", body, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a metric's samples whose label text contains ``labels``."""
        total = 0.0
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if labels in line:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def until(predicate, timeout: float, what: str = "the condition"):
    """Poll ``predicate`` until it returns something true (returned) or ``timeout`` seconds pass (an assertion
    fails): for states of another process, which sends no event here."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)


class Reply:
    def __init__(self, status: int, headers: dict, data: bytes):
        self.status = status
        self.headers = headers
        self.data = data

    @property
    def text(self) -> str:
        return self.data.decode()

    def json(self):
        return json.loads(self.data)

    def __repr__(self) -> str:
        return f"Reply({self.status}, {self.data[:300]!r})"


def loadtests(url: str, *runs: list[str], timeout: float = 180) -> list[dict]:
    """`clefcore loadtest` runs (each a list of its arguments) against ``url``, all at once; their reports."""
    procs = [subprocess.Popen([sys.executable, "-m", "clefcore.cli", "loadtest", "--url", url, "--json", "-",
                               *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
             for args in runs]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    return reports


def _json_or_none(line: str):
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# --- protocol §11: what strict clients (instructor-php, Effect, MemberJunction) verify ----------------------

def check_client_rules(request: dict, response: dict) -> None:
    assert isinstance(response.get("model"), str) and response["model"], response
    usage = response["usage"]
    for key in ("input_tokens", "output_tokens"):
        assert type(usage[key]) is int and usage[key] >= 0, usage
    answers = response["answers"]
    assert list(answers) == list(request["questions"]), (list(answers), list(request["questions"]))
    for qid, question in request["questions"].items():
        answer = answers[qid]
        kind = question["type"]
        assert answer["type"] == kind
        if kind == "noul":
            assert set(answer) == {"type", "noul"}, answer
            assert 0.0 <= answer["noul"] <= 1.0
            continue
        probs = answer["probabilities"]
        assert all(isinstance(p, (int, float)) and 0.0 <= p <= 1.0 for p in probs.values())
        assert abs(sum(probs.values()) - 1.0) <= 0.02, probs
        assert 0.0 <= answer["confidence"] <= 1.0
        assert all(math.isfinite(v) for v in probs.values())
        if kind == "choice":
            assert set(answer) == {"type", "choice", "confidence", "probabilities"}, answer
            assert list(probs) == list(question["criteria"]), (list(probs), list(question["criteria"]))
            assert answer["choice"] in question["criteria"]
            assert probs[answer["choice"]] >= max(probs.values()) - 1e-4
        else:
            levels = question["criteria"]
            keys = [str(i) for i in range(len(levels))]
            assert set(answer) == {"type", "score", "confidence", "probabilities", "legend"}, answer
            assert list(probs) == keys
            assert list(answer["legend"]) == keys
            assert [answer["legend"][k] for k in keys] == levels
            recomputed = sum(i * probs[k] for i, k in enumerate(keys))
            assert abs(answer["score"] - recomputed) <= 0.02, (answer["score"], recomputed)
            assert 0.0 <= answer["score"] <= len(levels) - 1


def same_answers(a: dict, b: dict, tol: float = 2e-4) -> bool:
    """Equal up to the last rounded digit: a packed batch and a lone request differ only in fp32
    summation order, which can move a 4-decimal value across a rounding boundary."""
    if list(a["answers"]) != list(b["answers"]) or a["usage"] != b["usage"]:
        return False
    for qid, x in a["answers"].items():
        y = b["answers"][qid]
        if x.keys() != y.keys() or x.get("choice") != y.get("choice") or x.get("legend") != y.get("legend"):
            return False
        for key in ("noul", "score", "confidence"):
            if key in x and abs(x[key] - y[key]) > tol:
                return False
        for k, p in x.get("probabilities", {}).items():
            if abs(p - y["probabilities"][k]) > tol:
                return False
    return True


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


# --- the batcher on a fake device ---------------------------------------------------------------------------

FAKE_STATUS = EngineStatus("fake", "cpu", "fp32", None, {}, 0, 0)   # what a fake device process reports


class Prepared(SimpleNamespace):
    """A prepared request as the batcher reads it (``num_tokens``; a test's ``name``); text only unless given
    ``images``: its cost is its tokens."""
    images = ()


def unwatched(metrics, stall_s: float = 30.0, grace_s: float = 60.0) -> DeviceWatch:
    """A device watch whose judgements go nowhere: for tests about scheduling, not stalls."""
    return DeviceWatch(metrics, stall_s, grace_s, on_change=lambda trouble: None, on_expired=lambda trouble: None)


# --- admission's hand-worked numbers (tests/test_admission.py, tests/test_admission_lanes.py) ---------------
# 1,000 tokens/s on each device, chunks of 1,000 tokens, aging at 1,000 tokens/s, budgets of 1 s up to 10 s at
# 10,000 tokens.
RATE = AGE_RATE = CHUNK = 1_000
BUDGETS = Budgets(1.0, 10.0, 10_000)
NOW = 1_000.0
IDLE = LaneView(0, 0.0, None, math.inf)


def entry(tokens: int, at: float) -> Entry:
    return Entry(None, tokens, at + 60, at)


def whole(*arrivals: tuple[int, float]) -> QueueView:
    """A queue of whole prompts, (tokens, arrival) each, as the scheduler orders them."""
    keyed = [(at + tokens / AGE_RATE, tokens) for tokens, at in arrivals]
    return QueueView(AGE_RATE, sum(tokens for _, tokens in keyed),
                     lambda key: sum(tokens for k, tokens in keyed if k <= key))


def view(queue: QueueView = whole(), long: tuple[Entry, ...] = (), lanes: tuple[LaneView, ...] = (IDLE,), *,
         chunk: int = CHUNK, share: float = 0.0, full: bool = False) -> Snapshot:
    """What the policy reads at NOW: ``long`` queued long prompts, keyed by their arrival and size."""
    keyed = tuple((e, e.enqueued_at + e.tokens / AGE_RATE) for e in long)
    return Snapshot(NOW, RATE, chunk, queue, keyed, lanes, share, full)


def batcher(devices=(None,), **kw) -> tuple[Batcher, Metrics]:
    """A batcher on these numbers, steps (batches and chunks) of 1,000 tokens, over ``devices`` (None: no
    device process, nothing dispatched: not started); ``kw`` changes them. Its metrics; no stall watch."""
    options = dict(max_queue=64, max_batch_tokens=1_000, max_batch_requests=8, budgets=BUDGETS,
                   chunk_tokens=CHUNK, age_rate=float(AGE_RATE), start_rate=float(RATE))
    options.update(kw)
    metrics = Metrics()
    return Batcher(list(devices), metrics, watch=unwatched(metrics), **options), metrics
