"""Push an image from an OCI layout directory to a registry, every request body at most --chunk-bytes.

    python3 deploy/image/push.py OCI_DIR[:TAG] [docker://]HOST/NAME:TAG [--chunk-bytes N] [--digestfile FILE]
                                 [--plain-http] [--retries N] [--timeout SECONDS]

Why: the registry (Forgejo) sits behind Cloudflare, which answers 413 to any request body over 100 MB, and
buildah, skopeo and docker send each blob in one request. The OCI distribution API also takes a blob in chunks
(POST an upload, a PATCH per chunk with its Content-Range, PUT ?digest=), which this does for the config and
every layer; the manifest goes last, as it is in the layout (same bytes, same digest).

OCI_DIR is what `buildah push IMAGE oci:DIR:NAME` wrote; TAG (needed only when it holds several images) picks
the manifest whose org.opencontainers.image.ref.name is TAG. Every blob's size and sha256 are checked before
anything is sent; blobs the registry already has are skipped, so a rerun sends only what is missing.

Retries: every request that meets a connection error, a timeout, 408, 429, 5xx or Cloudflare's 520-524 goes
again, at most --retries times in a row, after 1, 2, 4 ... 30 seconds or what the answer's Retry-After asks
(at most 300). A failed chunk goes on from the offset the registry then reports (in a new upload when the
registry lost this one). A failed `PUT ?digest=` (completing a blob) may have been committed with only its
answer lost: a HEAD of the blob decides before the blob goes again from byte 0.

Credentials: what `buildah login`, `podman login` or `docker login` stored, from the first of
$REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/auth.json, /run/containers/UID/auth.json,
~/.config/containers/auth.json, ~/.docker/config.json that names the host (credHelpers/credsStore through
docker-credential-NAME); anonymous when none. The registry's 401 picks Basic or the Bearer token flow.
They go only where they belong, as docker and containerd send them: the Authorization header only to the
registry's own scheme, host and port; the password (Basic) to the Bearer challenge's token realm only when
that is https (or http under --plain-http, which also prints a warning once credentials are used). An
upload's Location on another host is followed without credentials; one from https down to http is refused,
and so is any scheme but http(s). An answer's body is read up to MAX_ANSWER bytes (1 MiB; a registry's are a
few KB); a longer one stops the push. A registry that takes less than a quarter of a chunk's bytes, --retries
+ 1 PATCH requests in a row, is given up on: at that pace an image would take ever more requests.
Environment: CLEFCORE_IMAGE_PUSH_CHUNK (--chunk-bytes' default, else 95000000), CLEFCORE_IMAGE_PUSH_TLS=0
(as --plain-http), SSL_CERT_FILE or REQUESTS_CA_BUNDLE (CA bundle). Prints `pushed REF@DIGEST`; on failure one
line saying what and why, exit status 1. Standard library only: the build host runs it with its python3.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import io
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

from layout import LayoutError, blob_path, file_sha256, read_image

DEFAULT_CHUNK = 95_000_000
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
# any request answered so goes again; 520-524 are Cloudflare's "origin unreachable / timed out"
TRANSIENT = {408, 429, 500, 502, 503, 504, 520, 521, 522, 523, 524}
# a PATCH also on 404 (the upload is gone: a new one) and 416 (the offset was wrong: ask the registry)
PATCH_RETRY = TRANSIENT | {404, 416}
MAX_BACKOFF = 30          # seconds, the longest wait of our own
MAX_RETRY_AFTER = 300     # seconds, the longest Retry-After obeyed
NETWORK_ERRORS = (OSError, http.client.HTTPException)
MAX_ANSWER = 1 << 20      # bytes of an answer's body read at most: registries' JSON, proxies' pages are KBs
MIN_TAKEN = 4             # a PATCH whose bytes the registry took less than 1/MIN_TAKEN of is no progress
DEFAULT_PORTS = {"http": 80, "https": 443}


class PushError(Exception):
    """An expected failure: main prints it as one line and exits 1."""


# ---- the layout ------------------------------------------------------------------------------------------

def verify(path: Path, desc: dict) -> None:
    """The file holds exactly the descriptor's bytes (size, then sha256)."""
    if not path.is_file():
        raise PushError(f"{path}: missing (the layout names {desc['digest']})")
    if path.stat().st_size != desc["size"]:
        raise PushError(f"{path}: {path.stat().st_size} bytes, its descriptor says {desc['size']}")
    actual = file_sha256(path)
    if actual != desc["digest"]:
        raise PushError(f"{path}: its bytes hash to {actual}, not {desc['digest']} (corrupt layout)")


def checked_image(source: str) -> tuple[bytes, str, list[tuple[str, dict, Path]]]:
    """The manifest's bytes and media type, and (label, descriptor, file) of the config and each layer, every
    file checked against its descriptor."""
    root, tag = Path(source), None
    if not root.is_dir() and ":" in source:
        path, tag = source.split(":", 1)
        root = Path(path)
    image = read_image(root, tag)
    verify(blob_path(root, image.entry["digest"]), image.entry)
    if image.media_type not in MANIFEST_TYPES:
        raise PushError(f"{blob_path(root, image.entry['digest'])}: media type {image.media_type!r}; push.py "
                        f"pushes one image manifest ({', '.join(MANIFEST_TYPES)})")
    n = len(image.layers)
    blobs = [("config", image.config, blob_path(root, image.config["digest"]))]
    blobs += [(f"layer {i + 1}/{n}", d, blob_path(root, d["digest"])) for i, d in enumerate(image.layers)]
    for _, d, p in blobs:
        verify(p, d)
    return image.manifest, image.media_type, blobs


# ---- credentials -----------------------------------------------------------------------------------------

def auth_files() -> list[Path]:
    """Where buildah/podman (containers-auth.json(5)) and docker keep logins, in the order they read them."""
    files = [os.environ.get("REGISTRY_AUTH_FILE")]
    if os.environ.get("XDG_RUNTIME_DIR"):
        files.append(os.path.join(os.environ["XDG_RUNTIME_DIR"], "containers", "auth.json"))
    files += [f"/run/containers/{os.getuid()}/auth.json",
              os.path.expanduser("~/.config/containers/auth.json"),
              os.path.expanduser("~/.docker/config.json")]
    return [Path(f) for f in files if f]


def helper(name: str, host: str) -> tuple[str, str] | None:
    """(user, secret) from `docker-credential-NAME get`; None, with a note, when it has none for the host."""
    try:
        out = subprocess.run([f"docker-credential-{name}", "get"], input=host, capture_output=True, text=True,
                             timeout=60, check=True)
        found = json.loads(out.stdout)
        return found["Username"], found["Secret"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as e:
        print(f"push.py: docker-credential-{name} get {host}: no credentials ({e})", file=sys.stderr)
        return None


def credentials(host: str, name: str) -> tuple[tuple[str, str], str] | None:
    """((user, password), where from) for HOST/NAME, from the first auth file that names it."""
    for path in auth_files():
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise PushError(f"{path}: unreadable auth file ({e})") from None
        if host in config.get("credHelpers", {}):
            found = helper(config["credHelpers"][host], host)
            if found:
                return found, f"docker-credential-{config['credHelpers'][host]}"
        # keys: host[:port], maybe with a scheme, or host/namespace (containers-auth.json); the longest wins
        keys = {re.sub(r"^https?://", "", k).rstrip("/"): v for k, v in config.get("auths", {}).items()}
        for key in sorted((k for k in keys if f"{host}/{name}/".startswith(k + "/")), key=len, reverse=True):
            if keys[key].get("auth"):
                try:
                    plain = base64.b64decode(keys[key]["auth"], validate=True).decode()
                except ValueError:
                    raise PushError(f"{path}: the auth of {key} is not base64 of user:password") from None
                user, _, password = plain.partition(":")
                return (user, password), str(path)
        if config.get("credsStore"):
            found = helper(config["credsStore"], host)
            if found:
                return found, f"docker-credential-{config['credsStore']}"
    return None


# ---- the registry ----------------------------------------------------------------------------------------

def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, the port made explicit: what credentials are bound to."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise PushError(f"{url!r}: not a valid port") from None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        raise PushError(f"{url!r}: not an http(s) URL with a host")
    return parts.scheme, parts.hostname, port or DEFAULT_PORTS[parts.scheme]


def read_answer(r: http.client.HTTPResponse, what: str) -> bytes:
    """The answer's body, refused (PushError) when it is over MAX_ANSWER bytes: by its Content-Length before
    reading any of it, else (chunked, or up to the connection's end) after MAX_ANSWER + 1 bytes."""
    if r.length is not None:            # 0 for HEAD, whose Content-Length is the blob's, not this body's
        if r.length > MAX_ANSWER:
            raise PushError(f"{what}: the answer's body is {r.length} bytes, over the {MAX_ANSWER} push.py "
                            "reads (a registry answers in a few KB)")
        return r.read()
    body = r.read(MAX_ANSWER + 1)
    if len(body) > MAX_ANSWER:
        raise PushError(f"{what}: the answer's body goes on past the {MAX_ANSWER} bytes push.py reads (a "
                        "registry answers in a few KB)")
    return body


class Response:
    def __init__(self, status: int, reason: str, headers: http.client.HTTPMessage, body: bytes):
        self.status, self.reason, self.headers, self.body = status, reason, headers, body

    def message(self) -> str:
        """The registry's error JSON as `CODE: message`, a proxy's HTML page by its title, else the text's
        start, on one line."""
        try:
            errors = json.loads(self.body)["errors"]
            return "; ".join(f"{e.get('code', '?')}: {e.get('message', '')}" for e in errors)
        except (ValueError, KeyError, TypeError, AttributeError):
            text = self.body[:4096].decode("utf-8", "replace")
            title = re.search(r"<title>(.*?)</title>", text, re.I | re.S)
            return " ".join((title.group(1) if title else text).split())[:200]

    def __str__(self) -> str:
        status, text = f"{self.status} {self.reason}", self.message()
        return status + (f": {text}" if text and text != status else "")


def backoff(failures: int, r: Response | None) -> int:
    """Seconds to wait before retry number `failures`: what the answer's Retry-After asks (at most
    MAX_RETRY_AFTER), else 1, 2, 4 ... MAX_BACKOFF. Only Retry-After's seconds form is read; its date form,
    which registries and Cloudflare do not send, gets the backoff."""
    asked = r.headers.get("Retry-After", "").strip() if r is not None else ""
    if asked.isascii() and asked.isdigit():
        return min(int(asked), MAX_RETRY_AFTER)
    return min(2 ** (failures - 1), MAX_BACKOFF)


@dataclass
class Upload:
    """One blob's upload under way: its Location, the next byte to send, the other offsets the registry's last
    Range may mean (tried on 416), failed chunks in a row, PATCH requests answered 202, stalls."""
    label: str
    digest: str
    size: int
    path: Path
    location: str
    offset: int = 0
    alternatives: list[int] = field(default_factory=list)
    failures: int = 0
    patches: int = 0
    stalls: int = 0      # PATCHes in a row answered 202 with less than 1/MIN_TAKEN of their bytes taken

    @property
    def what(self) -> str:
        return f"{self.label} {self.digest}"


class Registry:
    def __init__(self, host: str, name: str, plain_http: bool, timeout: float, retries: int):
        self.base = f"{'http' if plain_http else 'https'}://{host}/v2/{name}/"
        self.origin = origin(self.base)
        self.host, self.name, self.timeout, self.retries = host, name, timeout, retries
        self.plain_http = plain_http
        self.warned = False
        cafile = os.environ.get("SSL_CERT_FILE") or os.environ.get("REQUESTS_CA_BUNDLE") or None
        try:
            self.tls = ssl.create_default_context(cafile=cafile)
        except (OSError, ssl.SSLError) as e:
            raise PushError(f"CA bundle {cafile} (SSL_CERT_FILE or REQUESTS_CA_BUNDLE): {e}") from None
        self.login = credentials(host, name)
        self.hint = f"log in with `buildah login {host}`"
        self.authorization: str | None = None
        # GET <upload> answers "Range: 0-<last byte>" in the spec and docker's registry (and "0-0" for none),
        # "0-<bytes received>" in Forgejo/Gitea: learned once per push (None: unknown, the spec's first).
        self.status_asked = False
        self.status_counts_bytes: bool | None = None

    def send(self, method: str, url: str, body: bytes = b"", headers: dict | None = None) -> Response:
        """One request on a connection of its own (none is kept to go stale between chunks); the body goes out
        in 64 KiB blocks, so --timeout bounds each block rather than the whole chunk."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.netloc, timeout=self.timeout, context=self.tls,
                                               blocksize=1 << 16)
        else:
            conn = http.client.HTTPConnection(parts.netloc, timeout=self.timeout, blocksize=1 << 16)
        headers = {"User-Agent": "clefcore-push", "Connection": "close", **(headers or {})}
        if body:
            headers["Content-Length"] = str(len(body))
        try:
            conn.connect()      # what fails here is the connection (refused, TLS), not the request
            try:
                conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""),
                             io.BytesIO(body) if body else None, headers)
            except OSError as sending:
                # A proxy refusing a body (413) answers and closes before reading it all: read that answer.
                try:
                    r = conn.getresponse()
                except NETWORK_ERRORS:
                    raise sending from None
            else:
                r = conn.getresponse()
            return Response(r.status, r.reason, r.headers, read_answer(r, f"{method} {url}"))
        finally:
            conn.close()

    def call(self, method: str, url: str, body: bytes = b"", headers: dict | None = None) -> Response:
        """send() with authentication: on 401, log in as the challenge asks (again when a token expired).
        Only a URL of the registry's own origin gets the Authorization header; another host's 401 is an
        error."""
        headers = dict(headers or {})
        ours = origin(url) == self.origin
        for attempt in (1, 2):
            if self.authorization and ours:
                headers["Authorization"] = self.authorization
            r = self.send(method, url, body, headers)
            if r.status != 401 or attempt == 2 or not ours:
                break
            self.authenticate(r)
        if r.status == 401 and not ours:
            raise PushError(f"{method} {url}: {r}; the registry sent the upload to another host, and push.py "
                            f"sends the credentials for {self.host} to no other host")
        if r.status == 401:
            who = f"the credentials from {self.login[1]}" if self.login else "anonymous access"
            raise PushError(f"{method} {url}: {r}; {who} refused - {self.hint}")
        return r

    def retrying(self, what: str, attempt: Callable[[], Response]) -> Response:
        """attempt() again after a network error or a TRANSIENT answer, at most --retries times in a row,
        waiting backoff() in between. Returns the first other answer; PushError naming `what` and the last
        failure once the retries are spent."""
        failures = 0
        while True:
            try:
                r = attempt()
            except NETWORK_ERRORS as e:
                r, answer = None, f"{type(e).__name__}: {e}"
            else:
                if r.status not in TRANSIENT:
                    return r
                answer = str(r)
            failures += 1
            if failures > self.retries:
                raise PushError(f"{what}: failed {failures} times in a row, last answer: {answer}")
            wait = backoff(failures, r)
            print(f"  {what}: {answer}; again in {wait}s", flush=True)
            time.sleep(wait)

    def request(self, what: str, method: str, url: str, body: bytes = b"",
                headers: dict | None = None) -> Response:
        """call() through retrying(): for every request that can simply go again (not a PATCH, whose retry
        depends on what the registry kept)."""
        return self.retrying(what, lambda: self.call(method, url, body, headers))

    def authenticate(self, r: Response) -> None:
        challenges = r.headers.get_all("WWW-Authenticate") or []
        bearer = next((c for c in challenges if c.lower().startswith("bearer ")), None)
        basic = base64.b64encode(":".join(self.login[0]).encode()).decode() if self.login else None
        if bearer is None:
            if not basic:
                raise PushError(f"{self.host} asks for credentials ({r}), none are stored - {self.hint}")
            self.warn_plain_http()
            self.authorization = f"Basic {basic}"
            return
        params = dict(re.findall(r'(\w+)="([^"]*)"', bearer))
        if "realm" not in params:
            raise PushError(f"{self.host}: a Bearer challenge without a realm: {bearer}")
        query = {"scope": f"repository:{self.name}:pull,push"}
        if "service" in params:
            query["service"] = params["service"]
        realm = params["realm"]
        scheme = urllib.parse.urlsplit(realm).scheme
        if scheme != "https" and not (scheme == "http" and self.plain_http):
            raise PushError(f"{self.host}: the token realm {realm!r} is not https: refused, the credentials "
                            "would cross the network readable (--plain-http allows an http realm)")
        origin(realm)       # a host to ask
        if basic:
            self.warn_plain_http()
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        headers = {"Authorization": f"Basic {basic}"} if basic else {}
        t = self.retrying(f"token from {realm}", lambda: self.send("GET", url, headers=headers))
        if t.status != 200:
            who = f"credentials from {self.login[1]}" if self.login else "no credentials (anonymous)"
            raise PushError(f"token from {realm} with {who}: {t} - {self.hint}")
        try:
            reply = json.loads(t.body)
            token = reply.get("token") or reply["access_token"]
        except (ValueError, KeyError, AttributeError):
            raise PushError(f"token from {realm}: no token in the answer: {t.body[:200]!r}") from None
        self.authorization = f"Bearer {token}"

    def warn_plain_http(self) -> None:
        """Once, as stored credentials are first used under --plain-http: they (or the token they buy)
        cross the network readable."""
        if self.plain_http and self.login and not self.warned:
            self.warned = True
            print(f"push.py: warning: plain HTTP: the credentials from {self.login[1]} go to {self.host} "
                  "unencrypted", file=sys.stderr, flush=True)

    def follow(self, what: str, current: str, location: str) -> str:
        """Where an upload's Location sends it, resolved against the URL whose answer named it. Another host
        is followed (call() gives it no credentials); a step from https down to http is refused."""
        url = urllib.parse.urljoin(current, location)
        if origin(url)[0] == "http" and origin(current)[0] == "https":
            raise PushError(f"{what}: the registry's Location {url} goes from https down to plain http: "
                            "refused")
        return url

    def failure(self, what: str, r: Response, body_bytes: int = 0) -> PushError:
        if r.status == 413:
            return PushError(f"{what}: 413: request body too large - lower --chunk-bytes (this body was "
                             f"{body_bytes} bytes; {r})")
        return PushError(f"{what}: {r}")

    def has_blob(self, digest: str) -> bool:
        r = self.request(f"HEAD blob {digest}", "HEAD", self.base + f"blobs/{digest}")
        if r.status not in (200, 404):
            raise self.failure(f"HEAD blob {digest}", r)
        return r.status == 200

    def upload_status(self, location: str) -> tuple[int, int | None]:
        """GET <upload>: its HTTP status (0: no answer) and the N of its `Range: 0-N` (None: not said). Asked
        once per failed chunk, whose own retries bound it: not retried itself."""
        try:
            r = self.call("GET", location)
        except NETWORK_ERRORS:
            return 0, None
        m = re.fullmatch(r"0-(\d+)", r.headers.get("Range", ""))
        return r.status, int(m.group(1)) if m and r.status in (200, 204) else None

    def learn_status_reading(self, location: str, held: int) -> None:
        """Once per push, right after a chunk that left the upload at `held` bytes: which reading of GET's
        Range this registry uses, so that a resume tries the right offset first."""
        if not self.status_asked:
            self.status_asked = True
            self.status_counts_bytes = {held - 1: False, held: True}.get(self.upload_status(location)[1])

    def resume_offsets(self, location: str, size: int, what: str) -> list[int] | None:
        """Where the upload can go on, from GET <upload>: the reading this registry uses first, then the other
        (tried on 416); [] when the registry does not say; None when it lost the upload (404: docker's
        registry, once a body broke off, as the offset in its Location's _state no longer matches)."""
        status, n = self.upload_status(location)
        if status == 404 or n is None:
            return None if status == 404 else []
        offsets = [n, n + 1] if self.status_counts_bytes else [n + 1, n]
        offsets = [o for o in offsets if o <= size]
        if not offsets:
            raise PushError(f"{what}: the registry reports Range 0-{n}, more than the blob's {size} bytes")
        return offsets

    def start_upload(self, what: str) -> str:
        r = self.request(f"{what}: starting an upload", "POST", self.base + "blobs/uploads/")
        if r.status != 202 or not r.headers.get("Location"):
            raise self.failure(f"{what}: starting an upload", r)
        return self.follow(f"{what}: starting an upload", self.base, r.headers["Location"])

    def upload(self, label: str, desc: dict, path: Path, chunk: int) -> int:
        """The blob in a new upload, a PATCH per chunk, then completed; all again from byte 0 when the
        registry lost the upload at its completion (at most --retries times). Returns how many PATCH
        requests were answered 202."""
        what, patches = f"{label} {desc['digest']}", 0
        for _ in range(self.retries + 1):
            up = Upload(label, desc["digest"], desc["size"], path, self.start_upload(what))
            with path.open("rb") as f:
                while up.offset < up.size:
                    self.send_chunk(up, f, chunk)
            patches += up.patches
            if self.complete(up):
                return patches
            print(f"  {label}: the registry lost the upload at its completion and does not hold the blob; "
                  "a new upload from byte 0", flush=True)
        raise PushError(f"{what}: the registry lost the upload at its completion {self.retries + 1} times")

    def send_chunk(self, up: Upload, f: BinaryIO, chunk: int) -> None:
        """PATCH the chunk at up.offset; move up on by what the registry reports it took, or resume()."""
        f.seek(up.offset)
        data = f.read(min(chunk, up.size - up.offset))
        end = up.offset + len(data) - 1
        try:
            r = self.call("PATCH", up.location, data, {"Content-Type": "application/octet-stream",
                                                       "Content-Range": f"{up.offset}-{end}"})
        except NETWORK_ERRORS as e:
            self.resume(up, end, None, f"{type(e).__name__}: {e}")
            return
        if r.status == 202:
            up.location = self.follow(f"{up.what}: bytes {up.offset}-{end}", up.location,
                                      r.headers.get("Location") or up.location)
            m = re.fullmatch(r"0-(\d+)", r.headers.get("Range", ""))
            held = int(m.group(1)) + 1 if m else end + 1
            if not up.offset < held <= end + 1:
                raise PushError(f"{up.what}: after bytes {up.offset}-{end} the registry reports Range "
                                f"{r.headers['Range']}")
            self.check_progress(up, held - up.offset, len(data))
            self.learn_status_reading(up.location, held)
            up.offset, up.failures, up.alternatives, up.patches = held, 0, [], up.patches + 1
            if up.size > chunk:
                print(f"  {up.label}: {up.offset}/{up.size} bytes", flush=True)
        elif r.status not in PATCH_RETRY:
            raise self.failure(f"{up.what}: bytes {up.offset}-{end}", r, len(data))
        elif r.status == 416 and up.alternatives:
            up.offset = up.alternatives.pop(0)
        else:
            self.resume(up, end, r, str(r))

    def check_progress(self, up: Upload, taken: int, sent: int) -> None:
        """A 202 that took less than 1/MIN_TAKEN of the chunk is a stall; give up after --retries + 1 in a row
        (a registry taking a byte per request would need a request per byte)."""
        up.stalls = up.stalls + 1 if taken * MIN_TAKEN < sent else 0
        if up.stalls > self.retries:
            raise PushError(f"{up.what}: the registry took {taken} of the {sent} bytes sent at offset "
                            f"{up.offset}, under 1/{MIN_TAKEN} of a chunk {up.stalls} times in a row - it is "
                            "not taking the upload; giving up")

    def resume(self, up: Upload, end: int, r: Response | None, answer: str) -> None:
        """After the chunk up.offset-end failed (`r`: the answer, None when there was none): give up after
        --retries in a row, else wait and go on where the registry says the upload stands, or in a new
        upload when it lost this one."""
        up.failures += 1
        if up.failures > self.retries:
            raise PushError(f"{up.what} ({up.path}): the chunk at offset {up.offset} failed {up.failures} "
                            f"times, last answer: {answer} - run push.py again to start this blob over")
        wait = backoff(up.failures, r)
        time.sleep(wait)
        failed, offsets = up.offset, self.resume_offsets(up.location, up.size, up.what)
        if offsets is None:
            up.location, up.offset, up.alternatives = self.start_upload(up.what), 0, []
            going_on = "the registry lost the upload: a new one from byte 0"
        else:
            up.offset, *up.alternatives = offsets or [up.offset]
            going_on = f"resuming at byte {up.offset}" + (
                f" (or {up.alternatives[0]} on 416)" if up.alternatives else "")
        print(f"  {up.label}: bytes {failed}-{end} failed ({answer}); after {wait}s, {going_on}", flush=True)

    def complete(self, up: Upload) -> bool:
        """PUT <upload>?digest=. True once the registry holds the blob, False when it lost the upload
        without storing the blob (404). A PUT whose answer was lost may have been committed (its retry then
        meets 404, or the retries run out): a HEAD of the blob decides rather than sending it all again."""
        sep = "&" if urllib.parse.urlsplit(up.location).query else "?"
        what = f"{up.what}: completing the upload"
        gave_up: PushError | None = None
        try:
            r = self.request(what, "PUT", f"{up.location}{sep}digest={urllib.parse.quote(up.digest)}")
        except PushError as e:
            gave_up, r = e, None
        if r is not None and r.status == 201:
            if r.headers.get("Docker-Content-Digest", up.digest) != up.digest:
                raise PushError(f"{up.what}: the registry stored it as {r.headers['Docker-Content-Digest']}")
            return True
        if self.has_blob(up.digest):
            print(f"  {up.label}: completing the upload was not answered 201, yet the registry holds "
                  f"{up.digest} (an earlier answer was lost)", flush=True)
            return True
        if gave_up is not None:
            raise gave_up
        if r.status == 404:
            return False
        raise self.failure(what, r)

    def put_manifest(self, tag: str, body: bytes, media_type: str) -> str:
        r = self.request(f"manifest {tag}", "PUT", self.base + f"manifests/{tag}", body,
                         {"Content-Type": media_type})
        if r.status != 201:
            raise self.failure(f"manifest {tag}", r, len(body))
        return r.headers.get("Docker-Content-Digest", "")


# ---- the command -----------------------------------------------------------------------------------------

def positive(option: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise PushError(f"{option} must be a positive whole number of bytes, not {text!r}")
    return int(text)


def push(args: argparse.Namespace) -> str:
    chunk = positive("--chunk-bytes" if args.chunk_bytes else "CLEFCORE_IMAGE_PUSH_CHUNK",
                     args.chunk_bytes or os.environ.get("CLEFCORE_IMAGE_PUSH_CHUNK") or str(DEFAULT_CHUNK))
    tls = os.environ.get("CLEFCORE_IMAGE_PUSH_TLS", "1")
    if tls not in ("0", "1"):
        raise PushError(f"CLEFCORE_IMAGE_PUSH_TLS must be 1 (HTTPS) or 0 (plain HTTP), not {tls!r}")
    ref = args.ref.removeprefix("docker://")
    m = re.fullmatch(r"([^/]+)/([^:@]+):([\w][\w.-]{0,127})", ref)
    if not m or not ("." in m.group(1) or ":" in m.group(1) or m.group(1) == "localhost"):
        raise PushError(f"REF {args.ref!r}: expected [docker://]HOST[:PORT]/NAME:TAG")
    host, name, tag = m.groups()
    body, media_type, blobs = checked_image(args.source)
    if len(body) > chunk:
        raise PushError(f"the manifest is {len(body)} bytes, over --chunk-bytes {chunk}")
    total = sum(d["size"] for _, d, _ in blobs)
    print(f"push.py: {args.source} ({len(blobs)} blobs, {total / 1e6:.1f} MB, checked) -> {ref}, "
          f"request bodies at most {chunk} bytes", flush=True)
    registry = Registry(host, name, args.plain_http or tls == "0", args.timeout, args.retries)
    for label, desc, path in blobs:
        if registry.has_blob(desc["digest"]):
            print(f"  {label} {desc['digest']}: already in the registry, skipped", flush=True)
            continue
        start = time.monotonic()
        n = registry.upload(label, desc, path, chunk)
        print(f"  {label} {desc['digest']}: {desc['size']} bytes sent, {n} PATCH request(s), "
              f"{time.monotonic() - start:.1f}s", flush=True)
    expected = "sha256:" + hashlib.sha256(body).hexdigest()
    digest = registry.put_manifest(tag, body, media_type)
    if digest and digest != expected:
        raise PushError(f"manifest {tag}: the registry answered digest {digest}, its bytes hash to "
                        f"{expected}")
    if not digest:
        print(f"  manifest: the registry sent no Docker-Content-Digest; {expected} is its bytes' hash",
              flush=True)
    return f"{host}/{name}:{tag}@{expected}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", metavar="OCI_DIR[:TAG]",
                   help="OCI layout directory (what buildah push oci:DIR wrote)")
    p.add_argument("ref", metavar="REF", help="[docker://]HOST[:PORT]/NAME:TAG")
    p.add_argument("--chunk-bytes", metavar="N",
                   help=f"largest request body (default: $CLEFCORE_IMAGE_PUSH_CHUNK or {DEFAULT_CHUNK})")
    p.add_argument("--digestfile", type=Path, help="write the manifest digest the registry returned here")
    p.add_argument("--plain-http", action="store_true",
                   help="plain HTTP (as CLEFCORE_IMAGE_PUSH_TLS=0), an http token realm allowed; warns when "
                        "credentials are used (default: HTTPS only)")
    p.add_argument("--retries", type=int, default=5,
                   help="how often a failed request goes again, in a row, and how many PATCH requests in a "
                        "row may have under a quarter of their bytes taken (default 5)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds without progress on a socket (default 300)")
    args = p.parse_args(argv)
    if args.retries < 0 or args.timeout <= 0:
        p.error("--retries must be 0 or more and --timeout more than 0")
    try:
        pushed = push(args)
    except (PushError, LayoutError) as e:
        print(f"push.py: {e}", file=sys.stderr)
        return 1
    except NETWORK_ERRORS as e:
        print(f"push.py: {args.ref}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.digestfile:
        args.digestfile.write_text(pushed.rsplit("@", 1)[1] + "\n")
    print(f"pushed {pushed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
