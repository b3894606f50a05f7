"""deploy/image/push.py against an in-process fake OCI registry (Registry below: its limits, auth flows and
injected failures), hostile ones included. No network, no GPU. The push runs as a subprocess where the command
line matters, in-process (main()) where the test replaces the backoff's sleep."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import shutil
import ssl
import subprocess
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

PUSH = Path(__file__).resolve().parent.parent / "deploy" / "image" / "push.py"
NAME = "owner/clefcore"
USER, PASSWORD = "builder", "pass:with colon"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CHUNK = 64_000
PUSH_ENV = ("REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "CLEFCORE_IMAGE_PUSH_CHUNK", "CLEFCORE_IMAGE_PUSH_TLS",
            "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
PLAIN_HTTP_WARNING = "push.py: warning: plain HTTP: the credentials from"
FLOOD = 10**9              # bytes of a hostile answer's body, generated as it is sent


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Registry:
    """The fake registry. `fail` maps the n-th PATCH it receives (1-based) to a failure:
    drop: reads half the body, keeps it, closes the connection without an answer;
    500: reads the body, keeps the first half, answers 500;
    502: keeps the whole body, answers 502 (the answer lost on the way, as from a proxy);
    503: keeps nothing, answers 503 (a proxy that never reached the registry);
    forget: as drop, and the upload is gone from then on (404), as in docker's registry, whose Location's
    _state no longer matches what it holds;
    short: keeps the first half and answers 202 with a Range that says so;
    trickle: keeps one byte and answers 202 with a Range that says so.
    `faults` maps (kind, n), the n-th authorized request of a kind ("HEAD", "POST", "PUT blob",
    "PUT manifest"; "token": the n-th token request), to a failure:
    drop: the connection closes without an answer, nothing done (a reset on the way to the registry);
    lost: the request is done (a blob committed, a token issued), then the connection closes without its
    answer;
    forget ("PUT blob"): the upload is gone, nothing committed, no answer;
    "503", "429", ...: that status, nothing done, with `Retry-After: retry_after` when that is set;
    flood, flood-stream: answers 200 with a FLOOD-byte body, its Content-Length said (flood) or not (streamed
    until the connection closes), sent until the client hangs up; entry["sent"]: the bytes that went out.
    `counts_bytes`: GET <upload> answers Range 0-<bytes held> as Forgejo does, else the spec's 0-<last byte>
    (0-0 when empty, as docker's registry).
    `tls`: (certificate, key) to serve HTTPS with. `location`: the scheme://host[:port] its Locations name,
    "{host}" standing for its own (absolute: its own scheme and host; default: relative Locations). `realm`:
    the Bearer challenge's token realm (default its own /token). `upload_host`: "open" or "locked" starts a
    second server on another port (`upload_host` becomes its host) that Locations send the uploads to, sharing
    this one's state: "open" takes them without credentials (as a storage host behind pre-signed URLs does),
    "locked" answers every request 401. Each log entry names the host that received it."""

    def __init__(self, limit: int, auth: str = "bearer", counts_bytes: bool = False, absolute: bool = False,
                 token_uses: int | None = None, lie_digest: bool = False,
                 tls: tuple[Path, Path] | None = None, location: str | None = None, realm: str | None = None,
                 upload_host: str | None = None):
        self.limit, self.auth, self.counts_bytes = limit, auth, counts_bytes
        self.token_uses, self.lie_digest = token_uses, lie_digest
        self.blobs: dict[str, bytes] = {}
        self.uploads: dict[str, bytearray] = {}
        self.states: dict[str, int] = {}
        self.manifests: dict[str, tuple[bytes, str]] = {}
        self.tokens: dict[str, int] = {}     # token -> uses left
        self.token_requests = 0
        self.fail: dict[int, str] = {}
        self.patches = 0
        self.faults: dict[tuple[str, int], str] = {}
        self.retry_after: str | None = None
        self.counts: Counter = Counter()
        self.log: list[dict] = []
        self.lock = threading.Lock()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                registry.handle(self)

            do_GET = do_POST = do_PATCH = do_PUT = do_HEAD

        self.servers = [self.serve(Handler, tls)]
        self.host = f"127.0.0.1:{self.servers[0].server_address[1]}"
        self.scheme = "https" if tls else "http"
        self.upload_lock, self.upload_host = upload_host, None
        if upload_host:
            self.servers.append(self.serve(Handler, None))
            self.upload_host = f"127.0.0.1:{self.servers[1].server_address[1]}"
            location = f"http://{self.upload_host}"
        self.base = (location or (f"{self.scheme}://{{host}}" if absolute else "")).format(host=self.host)
        self.realm = (realm or f"{self.scheme}://{{host}}/token").format(host=self.host)

    @staticmethod
    def serve(handler, tls: tuple[Path, Path] | None) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        return server

    def close(self):
        for server in self.servers:
            server.shutdown()
            server.server_close()

    # -- plumbing
    def answer(self, h, status: int, headers: dict | None = None, body: bytes = b"", *, entry: dict):
        entry["status"] = status
        h.send_response(status)
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def error(self, h, status: int, code: str, message: str, entry: dict, headers: dict | None = None):
        body = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
        self.answer(h, status, {"Content-Type": "application/json", **(headers or {})}, body, entry=entry)

    def location(self, upload: str) -> str:
        self.states[upload] += 1
        return f"{self.base}/v2/{NAME}/blobs/uploads/{upload}?_state={self.states[upload]}"

    def authorized(self, h) -> bool:
        got = h.headers.get("Authorization", "")
        if self.auth == "basic":
            return got == "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        token = got.removeprefix("Bearer ")
        if self.tokens.get(token, 0) <= 0:
            return False
        self.tokens[token] -= 1      # a token is good for token_uses requests, then it has expired
        return True

    def token(self, h, query: dict, entry: dict):
        self.token_requests += 1
        basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if h.headers.get("Authorization") != basic:
            return self.error(h, 401, "UNAUTHORIZED", "bad credentials", entry)
        if query.get("scope") != [f"repository:{NAME}:pull,push"] or \
                query.get("service") != ["fake-registry"]:
            return self.error(h, 400, "DENIED", f"unexpected token request {query}", entry)
        token = f"token-{self.token_requests}"
        self.tokens[token] = self.token_uses or 10**9
        key = "access_token" if self.token_requests % 2 else "token"    # registries answer either
        self.answer(h, 200, {"Content-Type": "application/json"}, json.dumps({key: token}).encode(),
                    entry=entry)

    # -- the API
    def handle(self, h):
        with self.lock:
            self.dispatch(h)

    def dispatch(self, h):
        url = urlsplit(h.path)
        query = parse_qs(url.query)
        length = int(h.headers.get("Content-Length", 0))
        entry = {"method": h.command, "path": url.path, "length": length,
                 "range": h.headers.get("Content-Range"), "auth": h.headers.get("Authorization"),
                 "host": f"127.0.0.1:{h.server.server_address[1]}"}
        self.log.append(entry)
        on_upload_host = entry["host"] == self.upload_host
        if length > self.limit:      # as the proxy does: decided on the header, the body is never read
            h.close_connection = True
            return self.error(h, 413, "TOO_LARGE", f"body over {self.limit} bytes", entry,
                              {"Connection": "close"})
        if url.path == "/token":
            if self.fault(h, "token", url.path, entry):
                return None
            return self.token(h, query, entry)
        failure = None
        if h.command == "PATCH":
            self.patches += 1
            failure = self.fail.get(self.patches)
        body = h.rfile.read(length // 2 if failure in ("drop", "forget") else length)
        if on_upload_host and self.upload_lock == "locked":
            return self.error(h, 401, "UNAUTHORIZED", "authentication required", entry,
                              {"WWW-Authenticate": 'Basic realm="upload"'})
        if not on_upload_host and not self.authorized(h):
            challenge = 'Basic realm="fake"' if self.auth == "basic" else (
                f'Bearer realm="{self.realm}",service="fake-registry",scope="repository:{NAME}:pull,push"')
            return self.error(h, 401, "UNAUTHORIZED", "authentication required", entry,
                              {"WWW-Authenticate": challenge})
        kind = {"HEAD": "HEAD", "POST": "POST"}.get(h.command) or \
            (h.command == "PUT" and ("PUT manifest" if "/manifests/" in url.path else "PUT blob"))
        if kind and self.fault(h, kind, url.path, entry):
            return None
        prefix = f"/v2/{NAME}/"
        if not url.path.startswith(prefix):
            return self.error(h, 404, "NAME_UNKNOWN", url.path, entry)
        rest = url.path[len(prefix):]
        if h.command == "HEAD" and rest.startswith("blobs/sha256:"):
            blob = self.blobs.get(rest[len("blobs/"):])
            if blob is None:
                return self.answer(h, 404, entry=entry)
            # the blob's size, as registries answer a HEAD: no body follows, however large it says
            return self.answer(h, 200, {"Docker-Content-Digest": rest[len("blobs/"):],
                                        "Content-Length": str(len(blob))}, entry=entry)
        if h.command == "POST" and rest == "blobs/uploads/":
            upload = f"u{len(self.states)}"
            self.uploads[upload], self.states[upload] = bytearray(), 0
            return self.answer(h, 202, {"Location": self.location(upload), "Range": "0-0"}, entry=entry)
        m = re.fullmatch(r"blobs/uploads/(u\d+)", rest)
        if m and m.group(1) not in self.uploads:
            return self.error(h, 404, "BLOB_UPLOAD_UNKNOWN", m.group(1), entry)
        if m:
            return self.upload(h, m.group(1), query, body, failure, entry)
        m = re.fullmatch(r"manifests/([\w.-]+)", rest)
        if h.command == "PUT" and m:
            return self.manifest(h, m.group(1), body, entry)
        return self.error(h, 404, "UNSUPPORTED", f"{h.command} {url.path}", entry)

    def fault(self, h, kind: str, path: str, entry: dict) -> bool:
        """Fail this request as self.faults says; True when that took the answer's place."""
        self.counts[kind] += 1
        fault = self.faults.get((kind, self.counts[kind]))
        entry["fault"] = fault
        if fault is None:
            return False
        h.close_connection = True
        if fault == "lost":          # done below; its answer goes nowhere
            h.wfile = io.BytesIO()
            return False
        if fault in ("drop", "forget"):
            if fault == "forget":
                del self.uploads[path.rsplit("/", 1)[1]]
            entry["status"] = "dropped"
            return True
        if fault.startswith("flood"):
            self.flood(h, fault == "flood", entry)
            return True
        self.error(h, int(fault), "UNAVAILABLE", f"injected {fault}", entry,
                   {"Retry-After": self.retry_after} if self.retry_after is not None else None)
        return True

    @staticmethod
    def flood(h, said: bool, entry: dict):
        """200 with a FLOOD-byte body, one 64 KiB block sent again and again until the client hangs up."""
        entry["status"], entry["sent"] = 200, 0
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header(*(("Content-Length", str(FLOOD)) if said else ("Connection", "close")))
        h.end_headers()
        block = b" " * 65536
        try:
            while entry["sent"] < FLOOD:
                h.wfile.write(block)
                entry["sent"] += len(block)
        except OSError:
            pass

    def upload(self, h, upload: str, query: dict, body: bytes, failure: str | None, entry: dict):
        held = self.uploads[upload]
        if h.command == "GET":
            end = len(held) if self.counts_bytes else max(len(held) - 1, 0)
            return self.answer(h, 204, {"Range": f"0-{end}"}, entry=entry)
        if query.get("_state") != [str(self.states[upload])]:
            return self.error(h, 400, "BLOB_UPLOAD_INVALID", "stale or missing _state", entry)
        if h.command == "PATCH":
            start, end = map(int, h.headers["Content-Range"].split("-"))
            if start != len(held):
                return self.error(h, 416, "BLOB_UPLOAD_INVALID", f"holds {len(held)} bytes, not {start}",
                                  entry)
            if failure in ("drop", "forget"):
                held += body
                entry["status"] = "dropped"
                h.close_connection = True
                if failure == "forget":
                    del self.uploads[upload]
                return None
            if end - start + 1 != len(body):
                return self.error(h, 400, "BLOB_UPLOAD_INVALID", "Content-Range and body disagree", entry)
            held += {None: body, "500": body[:len(body) // 2], "502": body, "503": b"",
                     "short": body[:len(body) // 2], "trickle": body[:1]}[failure]
            if failure and failure not in ("short", "trickle"):
                return self.error(h, int(failure), "UNAVAILABLE", f"injected {failure}", entry)
            return self.answer(h, 202, {"Location": self.location(upload), "Range": f"0-{len(held) - 1}"},
                               entry=entry)
        if h.command == "PUT":
            held += body
            digest = query.get("digest", [""])[0]
            if sha256(bytes(held)) != digest:
                return self.error(h, 400, "DIGEST_INVALID", f"content is {sha256(bytes(held))}", entry)
            self.blobs[digest] = bytes(held)
            del self.uploads[upload]
            return self.answer(h, 201, {"Docker-Content-Digest": digest}, entry=entry)
        return self.error(h, 405, "UNSUPPORTED", h.command, entry)

    def manifest(self, h, tag: str, body: bytes, entry: dict):
        manifest = json.loads(body)
        if h.headers.get("Content-Type") != manifest["mediaType"]:
            return self.error(h, 400, "MANIFEST_INVALID", "Content-Type is not the manifest's", entry)
        for desc in [manifest["config"], *manifest["layers"]]:
            if desc["digest"] not in self.blobs:
                return self.error(h, 400, "BLOB_UNKNOWN", desc["digest"], entry)
        self.manifests[tag] = (body, h.headers["Content-Type"])
        digest = sha256(body + b" ") if self.lie_digest else sha256(body)
        return self.answer(h, 201, {"Docker-Content-Digest": digest}, entry=entry)


@pytest.fixture
def registry():
    made = []

    def make(limit: int = 70_000, **kw) -> Registry:
        made.append(Registry(limit, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def image(tmp_path) -> dict:
    return make_layout(tmp_path / "oci")


def write_blob(layout: Path, data: bytes) -> dict:
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / sha256(data)[7:]).write_bytes(data)
    return {"digest": sha256(data), "size": len(data)}


def make_layout(layout: Path, sizes=(300_001, 3 * CHUNK, 123_457), seed: int = 0, tags=("clefcore:test",)):
    """An OCI layout as `buildah push IMAGE oci:DIR:NAME` writes it, with random (incompressible) layers of
    the given sizes. Returns {"manifest": bytes, "blobs": {digest: bytes}, "order": [config's, layers']}
    (digests)."""
    rng = random.Random(seed)
    layers = [rng.randbytes(n) for n in sizes]
    config = json.dumps({"architecture": "amd64", "os": "linux", "seed": seed,
                         "rootfs": {"type": "layers", "diff_ids": [sha256(x) for x in layers]}}).encode()
    cdesc = dict(write_blob(layout, config), mediaType="application/vnd.oci.image.config.v1+json")
    ldescs = [dict(write_blob(layout, x), mediaType=LAYER_TYPE) for x in layers]
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": cdesc,
                           "layers": ldescs}, indent=2).encode()
    entries = [dict(write_blob(layout, manifest), mediaType=MANIFEST_TYPE,
                    annotations={"org.opencontainers.image.ref.name": t}) for t in tags]
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": entries}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return {"manifest": manifest, "blobs": {sha256(x): x for x in [config, *layers]},
            "order": [sha256(config)] + [sha256(x) for x in layers]}


def auth_file(path: Path, host: str, password: str = PASSWORD) -> Path:
    token = base64.b64encode(f"{USER}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": token}}}))
    return path


def clean_env(tmp_path: Path, **extra) -> dict:
    """The caller's environment without its logins: HOME is tmp_path, no XDG_RUNTIME_DIR."""
    env = {k: v for k, v in os.environ.items() if k not in PUSH_ENV}
    return {**env, "HOME": str(tmp_path), **extra}


def login_env(tmp_path: Path, reg: Registry, **extra) -> dict:
    """clean_env with the registry's credentials in REGISTRY_AUTH_FILE."""
    return clean_env(tmp_path, REGISTRY_AUTH_FILE=str(auth_file(tmp_path / "auth.json", reg.host)), **extra)


def run_push(*args, env):
    return subprocess.run([sys.executable, str(PUSH), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def assert_pushed(reg: Registry, image: dict, tag: str = "test"):
    for digest, data in image["blobs"].items():
        assert reg.blobs.get(digest) == data, f"{digest} differs in the registry"
    assert reg.manifests[tag] == (image["manifest"], MANIFEST_TYPE)


def patches_of(reg: Registry) -> list[dict]:
    return [e for e in reg.log if e["method"] == "PATCH"]


def failure_line(rc: int, err: str, plain_http_login: bool = True) -> str:
    """A failed push's one line of stderr, no traceback, beside the warning a push with credentials over plain
    HTTP prints (asserted present, and only then)."""
    assert rc == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert any(line.startswith(PLAIN_HTTP_WARNING) for line in lines) == plain_http_login, err
    (line,) = [line for line in lines if not line.startswith(PLAIN_HTTP_WARNING)]
    return line


# ---- the whole push ---------------------------------------------------------------------------------------

def test_push_in_chunks_with_bearer_token(registry, tmp_path, image):
    """Every body at most --chunk-bytes (the registry refuses more than 70,000 bytes), every blob in
    ceil(size / chunk) PATCHes, a blob already there skipped after its HEAD, the manifest last; all
    byte-identical."""
    reg = registry()
    config, big, exact, small = image["order"]
    reg.blobs[small] = image["blobs"][small]              # pushed before: only its HEAD may happen
    env = login_env(tmp_path, reg)
    out = run_push(tmp_path / "oci", f"docker://{reg.host}/{NAME}:test", "--chunk-bytes", CHUNK,
                   "--plain-http", "--digestfile", tmp_path / "digest", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert_pushed(reg, image)
    manifest_digest = sha256(image["manifest"])
    assert (tmp_path / "digest").read_text().strip() == manifest_digest
    assert f"pushed {reg.host}/{NAME}:test@{manifest_digest}" in out.stdout
    assert f"{small}: already in the registry, skipped" in out.stdout

    assert max(e["length"] for e in reg.log) <= CHUNK
    assert reg.token_requests >= 1 and all(e["status"] == 401 for e in reg.log if e["auth"] is None)
    sizes = {d: len(b) for d, b in image["blobs"].items()}
    uploads = [e for e in reg.log if e["method"] == "POST"]
    assert len(uploads) == 3                               # config, big, exact; not small
    patches = patches_of(reg)
    expected = [-(-sizes[d] // CHUNK) for d in (config, big, exact)]
    assert len([p for p in patches if p["status"] == 202]) == sum(expected) == 1 + 5 + 3
    starts = [int(p["range"].split("-")[0]) for p in patches if p["status"] == 202]
    assert starts == [0] + [i * CHUNK for i in range(5)] + [i * CHUNK for i in range(3)]
    assert patches[5]["range"] == f"{4 * CHUNK}-{sizes[big] - 1}"     # the big layer's short last chunk
    heads = [e["path"].rsplit("/", 1)[1] for e in reg.log if e["method"] == "HEAD" and e["status"] != 401]
    assert heads == image["order"]
    answered = [e for e in reg.log if e["status"] != 401]
    assert answered[-1]["method"] == "PUT" and answered[-1]["path"] == f"/v2/{NAME}/manifests/test"
    assert sum("/manifests/" in e["path"] for e in answered) == 1


def test_chunk_over_the_proxy_limit_gets_413_and_a_smaller_one_passes(registry, tmp_path):
    """The registry refuses bodies over 1,000,000 bytes on the Content-Length and closes without reading them,
    as a proxy does, so sending a 20,000,000-byte chunk breaks off (more than the socket buffers take): the
    push still reads the 413 and says so in one line, no traceback. 1,000,000-byte chunks then push it."""
    reg = registry(limit=1_000_000)
    image = make_layout(tmp_path / "oci", sizes=(20_000_001,))
    env = login_env(tmp_path, reg, CLEFCORE_IMAGE_PUSH_TLS="0")
    out = run_push(tmp_path / "oci", f"{reg.host}/{NAME}:test", "--chunk-bytes", 20_000_000, env=env)
    assert "413: request body too large - lower --chunk-bytes" in failure_line(out.returncode, out.stderr)
    assert not reg.manifests
    ok = run_push(tmp_path / "oci", f"{reg.host}/{NAME}:test",
                  env={**env, "CLEFCORE_IMAGE_PUSH_CHUNK": "1000000"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert_pushed(reg, image)
    assert max(e["length"] for e in reg.log if e["status"] != 413) <= 1_000_000


# ---- failures and resumption ------------------------------------------------------------------------------

@pytest.fixture
def inproc(tmp_path, monkeypatch):
    """push.py loaded in-process (its directory on sys.path for `import layout`, as when run as a script), its
    backoff sleeps recorded instead of slept, logins only from tmp_path."""
    monkeypatch.syspath_prepend(str(PUSH.parent))
    spec = importlib.util.spec_from_file_location("clefcore_image_push", PUSH)
    push = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, push)     # dataclasses look their module up there
    spec.loader.exec_module(push)
    waits: list[float] = []
    monkeypatch.setattr(push.time, "sleep", waits.append)
    for k in PUSH_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    push.waits = waits
    return push


@pytest.fixture
def push(inproc, tmp_path, monkeypatch, capsys):
    """main() in-process, pushing tmp_path/oci to `reg` with its credentials: (exit status, stdout,
    stderr). Over HTTPS trusting the certificate `ca` when that is given, else --plain-http. Given `image`,
    the push must succeed with the registry holding it."""
    def run(reg: Registry, *args, ca: Path | None = None, image: dict | None = None) -> tuple[int, str, str]:
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth_file(tmp_path / "auth.json", reg.host)))
        if ca:
            monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        rc = inproc.main([str(tmp_path / "oci"), f"{reg.host}/{NAME}:test", "--chunk-bytes", str(CHUNK),
                          *([] if ca else ["--plain-http"]), *args])
        out = capsys.readouterr()
        if image is not None:
            assert rc == 0, out.out + out.err
            assert_pushed(reg, image)
        return rc, out.out, out.err
    return run


@pytest.mark.parametrize("counts_bytes", [False, True], ids=["spec-range", "forgejo-range"])
@pytest.mark.parametrize("nth", [1, 4], ids=["config-patch", "layer-patch"])
@pytest.mark.parametrize("failure", ["drop", "500", "502", "503"])
def test_failed_patch_resumes_where_the_registry_says(
        registry, image, inproc, push, failure, nth, counts_bytes):
    """The n-th PATCH fails; the push asks the registry (GET <upload>) what it holds and goes on from there:
    inside the chunk where the registry kept half of it, after it where it kept all. The 1st PATCH (the
    config's one chunk) fails before push.py learned how this registry's GET Range reads: where the two
    readings differ (0-0 when empty, or Forgejo's byte count), the spec's is tried first and the registry's
    416 sends it to the other. The 4th (the first layer's third chunk) fails after that: no 416."""
    reg = registry(counts_bytes=counts_bytes)
    reg.fail[nth] = failure
    _, out, err = push(reg, image=image)
    assert inproc.waits == [1]
    patches = patches_of(reg)
    failed = patches[nth - 1]
    start, end = map(int, failed["range"].split("-"))
    assert start == (0 if nth == 1 else 2 * CHUNK)
    assert failed["status"] == ("dropped" if failure == "drop" else int(failure))
    n = end - start + 1
    held = start + {"drop": n // 2, "500": n // 2, "502": n, "503": 0}[failure]
    after = reg.log[reg.log.index(failed) + 1:]
    assert after[0]["method"] == "GET"                    # where is the upload?
    if nth == 1 and failure == "502":     # the registry holds the whole config: the upload is completed
        assert (after[1]["method"], after[1]["status"]) == ("PUT", 201)
    else:
        resumed = next(p for p in patches[nth:] if p["status"] == 202)
        assert resumed["range"].startswith(f"{held}-")
    ambiguous = nth == 1 and (held == 0 or counts_bytes and held < end + 1)
    assert [p["status"] for p in patches].count(416) == int(ambiguous)
    resuming = re.search(rf"bytes {start}-{end} failed \(.*\); after 1s, resuming at byte (\d+)"
                         rf"(?: \(or (\d+) on 416\))?", out)
    assert resuming and resuming.group(2 if ambiguous else 1) == str(held)


def test_a_lost_upload_starts_again(registry, image, push):
    """The registry forgets the upload whose PATCH broke off (404 from then on): the blob goes again in a new
    upload from byte 0, and the image arrives whole."""
    reg = registry()
    reg.fail[3] = "forget"                                 # the first layer's second chunk
    _, out, err = push(reg, image=image)
    failed = patches_of(reg)[2]
    assert failed["range"] == f"{CHUNK}-{2 * CHUNK - 1}" and failed["status"] == "dropped"
    after = [e for e in reg.log[reg.log.index(failed) + 1:] if e["status"] != 401]
    assert [(e["method"], e["status"]) for e in after[:3]] == [("GET", 404), ("POST", 202), ("PATCH", 202)]
    assert after[2]["range"] == f"0-{CHUNK - 1}" and after[2]["path"] != failed["path"]
    assert "the registry lost the upload: a new one from byte 0" in out
    assert sum(e["method"] == "POST" for e in reg.log) == 4 + 1


def test_a_chunk_taken_in_part_goes_on_from_the_range(registry, image, inproc, push):
    """A PATCH answered 202 whose Range says the registry kept half of it: the next PATCH starts there."""
    reg = registry()
    reg.fail[3] = "short"
    _, out, err = push(reg, image=image)
    ranges = [p["range"] for p in patches_of(reg)[2:4]]
    assert ranges == [f"{CHUNK}-{2 * CHUNK - 1}", f"{CHUNK + CHUNK // 2}-{2 * CHUNK + CHUNK // 2 - 1}"]
    assert not inproc.waits


def test_gives_up_after_the_retries_naming_blob_offset_and_answer(registry, image, inproc, push):
    reg = registry()
    reg.fail.update({n: "503" for n in range(1, 100)})
    rc, _, err = push(reg, "--retries", "2")
    line = failure_line(rc, err)
    assert f"config {image['order'][0]}" in line and "chunk at offset 0 failed 3 times" in line
    assert "503 Service Unavailable: UNAVAILABLE: injected 503" in line
    # three tries at byte 0; before each retry the registry's "0-0" (empty, or byte 0?) costs one 416
    assert [p["status"] for p in patches_of(reg)] == [503, 416, 503, 416, 503] and inproc.waits == [1, 2]
    assert not reg.manifests


def chunks(image: dict) -> int:
    return sum(-(-len(b) // CHUNK) for b in image["blobs"].values())


def answered_after(reg: Registry, entry: dict) -> list[tuple[str, object]]:
    """(method, status) of the requests after `entry`, leaving out 401s (token renewals)."""
    return [(e["method"], e["status"]) for e in reg.log[reg.log.index(entry) + 1:] if e["status"] != 401]


@pytest.mark.parametrize("fault, retry_after, waits", [
    ("lost", None, [1]),         # committed, its answer lost: the PUT again meets 404, a HEAD finds the blob
    ("drop", None, [1]),         # lost on the way to the registry: the PUT again completes it
    ("503", "7", [7]),           # Retry-After obeyed
    ("429", "100000", ["cap"]),  # ... up to MAX_RETRY_AFTER
    ("429", "soon", [1]),        # not seconds: the backoff
])
def test_a_failed_completion_goes_again_and_a_committed_blob_is_not_sent_again(
        registry, image, inproc, push, fault, retry_after, waits):
    """The first layer's (300,001 bytes, 5 chunks) `PUT ?digest=` fails: it goes again, and where the
    registry already committed the blob, a HEAD says so; no chunk is sent twice, no second upload begun."""
    reg = registry()
    reg.faults[("PUT blob", 2)] = fault
    reg.retry_after = retry_after
    _, out, err = push(reg, image=image)
    assert inproc.waits == [inproc.MAX_RETRY_AFTER if w == "cap" else w for w in waits]
    assert inproc.MAX_RETRY_AFTER < 100000
    assert sum(e["method"] == "POST" for e in reg.log) == len(image["blobs"])
    assert [p["status"] for p in patches_of(reg)] == [202] * chunks(image)
    failed = next(e for e in reg.log if e.get("fault") == fault)
    layer = image["order"][1]
    assert failed["method"] == "PUT" and failed["path"].startswith(f"/v2/{NAME}/blobs/uploads/")
    if fault == "lost":
        assert answered_after(reg, failed)[:2] == [("PUT", 404), ("HEAD", 200)]
        assert f"yet the registry holds {layer}" in out
    else:
        assert answered_after(reg, failed)[0] == ("PUT", 201)
    assert f"layer 1/3 {layer}: completing the upload: " in out and f"again in {inproc.waits[0]}s" in out


def test_a_completion_whose_upload_the_registry_lost_sends_the_blob_again(registry, image, inproc, push):
    """The registry drops the upload at the `PUT ?digest=` without storing the blob: the PUT again meets 404,
    the HEAD 404, and the blob goes again in a new upload from byte 0."""
    reg = registry()
    reg.faults[("PUT blob", 2)] = "forget"
    _, out, err = push(reg, image=image)
    failed = next(e for e in reg.log if e.get("fault") == "forget")
    assert answered_after(reg, failed)[:4] == [("PUT", 404), ("HEAD", 404), ("POST", 202), ("PATCH", 202)]
    layer_chunks = -(-len(image["blobs"][image["order"][1]]) // CHUNK)
    assert [p["status"] for p in patches_of(reg)] == [202] * (chunks(image) + layer_chunks)
    assert sum(e["method"] == "POST" for e in reg.log) == len(image["blobs"]) + 1
    assert "does not hold the blob; a new upload from byte 0" in out and inproc.waits == [1]


@pytest.mark.parametrize("kind, fault", [("POST", "drop"), ("POST", "429"), ("PUT manifest", "lost"),
                                         ("PUT manifest", "503"), ("token", "drop"), ("token", "503"),
                                         ("HEAD", "drop")])
def test_other_requests_go_again(registry, image, inproc, push, kind, fault):
    """A connection lost or a 429/503 (with Retry-After: 3) on starting an upload, the manifest, the token
    request or a HEAD: that request goes again after the wait, the push completes, every chunk sent once."""
    reg = registry()
    reg.faults[(kind, 1)] = fault
    reg.retry_after = "3"
    _, out, err = push(reg, image=image)
    assert inproc.waits == [3 if fault.isdigit() else 1]
    assert [p["status"] for p in patches_of(reg)] == [202] * chunks(image)
    failed = [e for e in reg.log if e.get("fault") == fault]
    assert len(failed) == 1
    assert failed[0]["path"] == "/token" if kind == "token" else failed[0]["method"] == kind.split()[0]
    ok = {"POST": 202, "PUT": 201, "GET": 200, "HEAD": 404}[failed[0]["method"]]
    assert answered_after(reg, failed[0])[0] == (failed[0]["method"], ok)
    assert f"; again in {inproc.waits[0]}s" in out


@pytest.mark.parametrize("kind, fault, message", [
    ("PUT blob", "503", "config {config}: completing the upload: failed 3 times in a row, last answer: "
                        "503 Service Unavailable: UNAVAILABLE: injected 503"),
    ("PUT manifest", "503", "manifest test: failed 3 times in a row, last answer: 503"),
    ("POST", "429", "config {config}: starting an upload: failed 3 times in a row, last answer: 429"),
    ("token", "503", "token from http://{host}/token: failed 3 times in a row, last answer: 503"),
    ("HEAD", "drop", "HEAD blob {config}: failed 3 times in a row, last answer: RemoteDisconnected"),
])
def test_a_persistent_failure_gives_up_in_one_line(registry, image, inproc, push, kind, fault, message):
    """Every request of one kind fails: after --retries 2 (waits 1 s, 2 s) the push stops with one line
    naming the request and its last answer; a completion that never got its 201 is first checked by a HEAD."""
    reg = registry()
    reg.faults.update({(kind, n): fault for n in range(1, 50)})
    rc, out, err = push(reg, "--retries", "2")
    assert message.format(config=image["order"][0], host=reg.host) in failure_line(rc, err)
    assert inproc.waits == [1, 2]
    assert sum(e.get("fault") == fault for e in reg.log) == 3
    assert not reg.manifests
    if kind == "PUT blob":
        assert (reg.log[-1]["method"], reg.log[-1]["status"]) == ("HEAD", 404)
        assert reg.log[-1]["path"].endswith(image["order"][0])


def test_an_expired_token_is_renewed(registry, image, inproc, push):
    """Each token is good for 4 requests: the push meets 401 mid-upload, fetches a new token, goes on."""
    reg = registry(token_uses=4)
    _, out, err = push(reg, image=image)
    assert reg.token_requests >= 5 and not inproc.waits


def test_corrupt_layout_fails_before_any_request_naming_the_file(registry, tmp_path, image):
    reg = registry()
    layer = tmp_path / "oci" / "blobs" / "sha256" / image["order"][2][7:]
    data = bytearray(layer.read_bytes())
    data[1000] ^= 1
    layer.write_bytes(data)
    env = login_env(tmp_path, reg)
    out = run_push(tmp_path / "oci", f"{reg.host}/{NAME}:test", "--plain-http", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert str(layer) in out.stderr and "corrupt" in out.stderr and image["order"][2] in out.stderr
    layer.write_bytes(data[:-1])
    out = run_push(tmp_path / "oci", f"{reg.host}/{NAME}:test", "--plain-http", env=env)
    assert out.returncode == 1 and str(layer) in out.stderr
    assert f"its descriptor says {len(data)}" in out.stderr
    assert reg.log == []


# ---- credentials, references, options ---------------------------------------------------------------------

def test_basic_auth_from_docker_config_and_absolute_locations(registry, tmp_path):
    """Basic auth (401 WWW-Authenticate: Basic) with credentials from ~/.docker/config.json; the registry's
    Locations are absolute URLs with a query that must come back."""
    reg = registry(auth="basic", absolute=True)
    image = make_layout(tmp_path / "oci", sizes=(150_000,))
    (tmp_path / ".docker").mkdir()
    auth_file(tmp_path / ".docker" / "config.json", reg.host)
    out = run_push(f"{tmp_path / 'oci'}:clefcore:test", f"{reg.host}/{NAME}:test", "--chunk-bytes", CHUNK,
                   "--plain-http", env=clean_env(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert_pushed(reg, image)
    assert reg.token_requests == 0


def test_refused_or_missing_credentials_say_how_to_log_in(registry, tmp_path):
    reg = registry()
    make_layout(tmp_path / "oci", sizes=(1000,))
    wrong = auth_file(tmp_path / "wrong.json", reg.host, password="nope")
    out = run_push(tmp_path / "oci", f"{reg.host}/{NAME}:test", "--plain-http",
                   env=clean_env(tmp_path, REGISTRY_AUTH_FILE=str(wrong)))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"credentials from {wrong}" in out.stderr and "401" in out.stderr and "buildah login" in out.stderr
    out = run_push(tmp_path / "oci", f"{reg.host}/{NAME}:test", "--plain-http", env=clean_env(tmp_path))
    assert out.returncode == 1 and "anonymous" in out.stderr and "buildah login" in out.stderr
    basic = registry(auth="basic")
    out = run_push(tmp_path / "oci", f"{basic.host}/{NAME}:test", "--plain-http", env=clean_env(tmp_path))
    assert out.returncode == 1 and "none are stored" in out.stderr


def test_credentials_lookup(tmp_path, inproc, monkeypatch):
    """The most specific auths key wins (containers-auth.json namespaces), a key for another host never
    matches, the first file that names the host wins, and credHelpers run docker-credential-NAME get."""
    host = "registry.example:5000"
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    first = tmp_path / "first.json"
    first.write_text(json.dumps({"auths": {host: {"auth": b64("u1:p1")},
                                           f"{host}/owner": {"auth": b64("u2:p2")},
                                           f"{host}/other": {"auth": b64("u3:p3")}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(first))
    (tmp_path / ".docker").mkdir()
    (tmp_path / ".docker" / "config.json").write_text(json.dumps(
        {"auths": {"https://elsewhere.example": {"auth": b64("x:y")}},
         "credHelpers": {"elsewhere.example": "fake"}}))
    assert inproc.credentials(host, "owner/clefcore") == (("u2", "p2"), str(first))
    assert inproc.credentials(host, "someone/clefcore") == (("u1", "p1"), str(first))
    assert inproc.credentials("nowhere.example", "a/b") is None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-fake"
    helper.write_text("#!/bin/sh\nread host\nprintf "
                      """'{"ServerURL": "%s", "Username": "hu", "Secret": "%s-secret"}' "$host" "$host"\n""")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    found = inproc.credentials("elsewhere.example", "a/b")
    assert found == (("hu", "elsewhere.example-secret"), "docker-credential-fake")


def test_manifest_over_the_chunk_size_fails_before_any_request(registry, tmp_path, push):
    reg = registry()
    image = make_layout(tmp_path / "oci", sizes=(1000,))
    rc, _, err = push(reg, "--chunk-bytes", "300")          # the last --chunk-bytes given counts
    assert rc == 1 and f"the manifest is {len(image['manifest'])} bytes, over --chunk-bytes 300" in err
    assert reg.log == []


def test_registry_digest_must_match_the_manifest(registry, tmp_path, push):
    reg = registry(lie_digest=True)
    make_layout(tmp_path / "oci", sizes=(1000,))
    rc, _, err = push(reg, "--digestfile", str(tmp_path / "digest"))
    assert rc == 1 and "the registry answered digest" in err
    assert not (tmp_path / "digest").exists()


def test_layout_with_several_images_needs_a_tag(tmp_path, inproc):
    make_layout(tmp_path / "oci", sizes=(100,), tags=("clefcore:a", "clefcore:b"))
    with pytest.raises(inproc.LayoutError, match="2 manifests match, expected 1.*clefcore:a, clefcore:b"):
        inproc.checked_image(str(tmp_path / "oci"))
    body, media_type, blobs = inproc.checked_image(f"{tmp_path / 'oci'}:clefcore:b")
    assert media_type == MANIFEST_TYPE and [label for label, _, _ in blobs] == ["config", "layer 1/1"]
    with pytest.raises(inproc.LayoutError, match="0 manifests match 'clefcore:c'"):
        inproc.checked_image(f"{tmp_path / 'oci'}:clefcore:c")


@pytest.mark.parametrize("ref, args, env, message", [
    ("registry.example/owner/clefcore:1", ["--chunk-bytes", "0"], {},
     "--chunk-bytes must be a positive whole number of bytes, not '0'"),
    ("registry.example/owner/clefcore:1", [], {"CLEFCORE_IMAGE_PUSH_CHUNK": "95MB"},
     "CLEFCORE_IMAGE_PUSH_CHUNK must be a positive whole number of bytes, not '95MB'"),
    ("registry.example/owner/clefcore:1", [], {"CLEFCORE_IMAGE_PUSH_TLS": "no"},
     "CLEFCORE_IMAGE_PUSH_TLS must be 1 (HTTPS) or 0 (plain HTTP), not 'no'"),
    ("registry.example/owner/clefcore", [], {}, "expected [docker://]HOST[:PORT]/NAME:TAG"),
    ("owner/clefcore:1", [], {}, "expected [docker://]HOST[:PORT]/NAME:TAG"),
    ("registry.example/owner/clefcore:1", [], {"SSL_CERT_FILE": "{tmp}/no-such-ca.pem"},
     "CA bundle {tmp}/no-such-ca.pem (SSL_CERT_FILE"),
])
def test_bad_options_are_named(tmp_path, inproc, capsys, monkeypatch, ref, args, env, message):
    make_layout(tmp_path / "oci", sizes=(100,))
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(tmp=tmp_path))
    assert inproc.main([str(tmp_path / "oci"), ref, *args]) == 1
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_https_is_the_default(registry, tmp_path, inproc, capsys, monkeypatch):
    """Without --plain-http the push speaks TLS: to the plain-HTTP registry that is one clear error."""
    reg = registry()
    make_layout(tmp_path / "oci", sizes=(100,))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth_file(tmp_path / "auth.json", reg.host)))
    rc = inproc.main([str(tmp_path / "oci"), f"{reg.host}/{NAME}:test"])
    assert "SSL" in failure_line(rc, capsys.readouterr().err, plain_http_login=False)
    assert not reg.manifests


# ---- hostile registries ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory) -> tuple[Path, Path]:
    """(certificate, key): self-signed for 127.0.0.1 by openssl; the certificate is the push's CA bundle."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run([shutil.which("openssl") or "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.parametrize("auth", ["bearer", "basic"])
def test_uploads_sent_to_another_host_get_no_credentials(registry, image, push, auth):
    """The registry's Locations send every upload to a second host (another port: another origin), which takes
    them without credentials: the push completes, and not one request to that host carries Authorization."""
    reg = registry(auth=auth, upload_host="open")
    _, out, err = push(reg, image=image)
    elsewhere = [e for e in reg.log if e["host"] == reg.upload_host]
    assert [e for e in elsewhere if e["method"] == "PATCH"] == patches_of(reg)
    assert len(elsewhere) > chunks(image)
    assert {e["method"] for e in elsewhere} == {"PATCH", "GET", "PUT"}
    assert [e["auth"] for e in elsewhere] == [None] * len(elsewhere)
    home = [e for e in reg.log if e["host"] == reg.host and e["status"] != 401]
    assert home and all(e["auth"] for e in home)       # the registry itself got them on every request


def test_another_hosts_401_is_an_error_not_a_login(registry, image, push):
    """The host the uploads are sent to asks for credentials: it gets none, and the push stops saying why."""
    reg = registry(upload_host="locked")
    rc, out, err = push(reg)
    line = failure_line(rc, err)
    assert f"push.py sends the credentials for {reg.host} to no other host" in line and "401" in line
    elsewhere = [e for e in reg.log if e["host"] == reg.upload_host]
    assert [(e["method"], e["auth"]) for e in elsewhere] == [("PATCH", None)]
    assert not reg.manifests


@pytest.mark.parametrize("location", ["https://{host}", "http://{host}"], ids=["https", "down-to-http"])
def test_https_push_and_a_location_down_to_http_is_refused(registry, tls_cert, image, push, location):
    """Over HTTPS (no --plain-http), with the token flow: absolute https Locations push the image; a Location
    that goes down to plain http is refused before anything is sent there, naming it. No plain-HTTP
    warning."""
    reg = registry(tls=tls_cert, location=location)
    rc, out, err = push(reg, ca=tls_cert[0])
    if location.startswith("https"):
        assert rc == 0, out + err
        assert_pushed(reg, image)
        assert reg.token_requests >= 1 and PLAIN_HTTP_WARNING not in err
        return
    line = failure_line(rc, err, plain_http_login=False)
    assert f"Location http://{reg.host}/v2/{NAME}/blobs/uploads/u0?_state=1 goes from https down to plain " \
           "http: refused" in line
    assert not patches_of(reg) and not reg.manifests


@pytest.mark.parametrize("realm, plain", [("http://{plain}/token", False), ("ftp://{host}/token", True),
                                          ("file:///etc/passwd", True)], ids=["http", "ftp", "file"])
def test_a_token_realm_that_is_not_https_is_refused(registry, tls_cert, tmp_path, push, realm, plain):
    """An https registry whose challenge names a plain-http realm (a recording server here): refused, and the
    password never goes there. Under --plain-http an http realm is allowed (every push above), but any other
    scheme is refused all the same."""
    listener = registry()
    realm = realm.format(plain=listener.host, host="{host}")
    reg = registry(realm=realm, **({} if plain else {"tls": tls_cert}))
    make_layout(tmp_path / "oci", sizes=(1000,))
    rc, out, err = push(reg, ca=None if plain else tls_cert[0])
    line = failure_line(rc, err, plain_http_login=False)
    assert f"the token realm {reg.realm!r} is not https: refused" in line
    assert reg.token_requests == 0 and listener.log == []
    assert all(e["auth"] is None for e in reg.log)


@pytest.mark.parametrize("fault", ["flood", "flood-stream"], ids=["content-length", "streamed"])
@pytest.mark.parametrize("kind", ["token", "POST"])
def test_a_huge_answer_is_not_read_whole(registry, tmp_path, inproc, push, kind, fault):
    """The token request or the upload's start is answered with a 1 GB body, generated as it is sent: with its
    Content-Length said, the push refuses it unread; streamed without one, it stops after MAX_ANSWER bytes and
    hangs up. Either way one line names the limit, and the server sent a sliver of the gigabyte (what the
    sockets' buffers hold)."""
    reg = registry()
    reg.faults[(kind, 1)] = fault
    make_layout(tmp_path / "oci", sizes=(1000,))
    rc, out, err = push(reg)
    line = failure_line(rc, err)
    said = f"the answer's body is {FLOOD} bytes, over the {inproc.MAX_ANSWER} push.py reads"
    streamed = f"the answer's body goes on past the {inproc.MAX_ANSWER} bytes push.py reads"
    assert (said if fault == "flood" else streamed) in line
    with reg.lock:                                     # the flood's handler holds it until it stops sending
        (flooded,) = [e for e in reg.log if e.get("fault") == fault]
    assert inproc.MAX_ANSWER == 2**20 and flooded["sent"] < 64 * 2**20 < FLOOD
    assert not reg.manifests


def test_a_head_saying_a_large_blob_size_is_no_large_answer(registry, tmp_path, push):
    """A HEAD's Content-Length is the blob's size (3 MB here, over MAX_ANSWER) and no body follows: the blobs
    the registry holds are skipped, and the manifest goes."""
    reg = registry()
    image = make_layout(tmp_path / "oci", sizes=(3_000_000,))
    reg.blobs.update(image["blobs"])
    _, out, err = push(reg, image=image)
    assert not patches_of(reg) and out.count("already in the registry, skipped") == 2


def test_a_registry_taking_a_byte_per_patch_is_given_up_on(registry, image, inproc, push):
    """Every PATCH is answered 202 with one byte taken: after --retries 2, three in a row, the push stops
    naming the blob, the offset and the bytes taken."""
    reg = registry()
    reg.fail.update({n: "trickle" for n in range(1, 100)})
    rc, out, err = push(reg, "--retries", "2")
    line = failure_line(rc, err)
    config = image["order"][0]
    size = len(image["blobs"][config])
    assert f"config {config}: the registry took 1 of the {size - 2} bytes sent at offset 2, under 1/4 of a " \
           "chunk 3 times in a row" in line
    ranges = [(p["status"], p["range"]) for p in patches_of(reg)]
    assert ranges == [(202, f"{n}-{size - 1}") for n in range(3)]
    assert not reg.manifests and not inproc.waits


@pytest.mark.parametrize("retries, pushed", [("2", True), ("1", False)])
def test_stalls_count_in_a_row(registry, image, push, retries, pushed):
    """Two PATCHes in a row take one byte each (the first layer's second chunk, then its rest), then the
    registry takes whole chunks again: --retries 2 rides it out, --retries 1 gives up at the second."""
    reg = registry()
    reg.fail.update({3: "trickle", 4: "trickle"})
    rc, out, err = push(reg, "--retries", retries)
    starts = [int(p["range"].split("-")[0]) for p in patches_of(reg)]
    if pushed:
        assert rc == 0, out + err
        assert_pushed(reg, image)
        assert starts[1:5] == [0, CHUNK, CHUNK + 1, CHUNK + 2]
    else:
        assert rc == 1 and "under 1/4 of a chunk 2 times in a row" in err
        assert starts == [0, 0, CHUNK, CHUNK + 1]
