"""Push an image from an OCI layout directory to a registry, every request body at most --chunk-bytes.

    python3 deploy/image/push.py OCI_DIR[:TAG] [docker://]HOST/NAME:TAG [--chunk-bytes N] [--digestfile FILE]
                                 [--plain-http] [--retries N] [--timeout SECONDS]

Why: the registry (Forgejo) sits behind Cloudflare, which answers 413 to any request body over 100 MB, and
buildah, skopeo and docker send each blob in one request. The OCI distribution API also takes a blob in chunks
(POST an upload, a PATCH per chunk with its Content-Range, PUT ?digest=), which this does for the config and
every layer; the manifest goes last, as it is in the layout (same bytes, same digest).

OCI_DIR is what `buildah push IMAGE oci:DIR:NAME` wrote; TAG (needed only when it holds several images) picks
the manifest whose org.opencontainers.image.ref.name is TAG. Every blob's size and sha256 are checked before
anything is sent; blobs the registry already has are skipped, so a rerun sends only what is missing. A failed
chunk (connection error, timeout, 5xx, 416) goes again from the offset the registry reports (in a new upload
when the registry lost this one), at most --retries times in a row.

Credentials: what `buildah login`, `podman login` or `docker login` stored, from the first of
$REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/auth.json, /run/containers/UID/auth.json,
~/.config/containers/auth.json, ~/.docker/config.json that names the host (credHelpers/credsStore through
docker-credential-NAME); anonymous when none. The registry's 401 picks Basic or the Bearer token flow.
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
from pathlib import Path

DEFAULT_CHUNK = 95_000_000
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
# a PATCH answered so is retried; 52x are Cloudflare's "origin unreachable/timed out"
RETRY_STATUS = {404, 408, 416, 429, 500, 502, 503, 504, 520, 522, 523, 524}
NETWORK_ERRORS = (OSError, http.client.HTTPException)


class PushError(Exception):
    """An expected failure: main prints it as one line and exits 1."""


# ---- the layout ------------------------------------------------------------------------------------------

def blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise PushError(f"{layout}: digest {digest!r} is not sha256:<64 hex digits>")
    return layout / "blobs" / algo / hexdigest


def verify(path: Path, desc: dict) -> None:
    """The file holds exactly the descriptor's bytes (size, then sha256, streamed)."""
    if not path.is_file():
        raise PushError(f"{path}: missing (the layout names {desc['digest']})")
    if path.stat().st_size != desc["size"]:
        raise PushError(f"{path}: {path.stat().st_size} bytes, its descriptor says {desc['size']}")
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    if "sha256:" + h.hexdigest() != desc["digest"]:
        raise PushError(f"{path}: its bytes hash to sha256:{h.hexdigest()}, not {desc['digest']} "
                        "(corrupt layout)")


def read_image(source: str) -> tuple[bytes, str, list[tuple[str, dict, Path]]]:
    """The manifest's bytes and media type, and (label, descriptor, file) of the config and each layer."""
    layout, tag = Path(source), None
    if not layout.is_dir() and ":" in source:
        path, tag = source.split(":", 1)
        layout = Path(path)
    try:
        entries = json.loads((layout / "index.json").read_text())["manifests"]
    except (OSError, ValueError, KeyError) as e:
        raise PushError(f"{layout}: not an OCI layout ({e})") from None
    names = [e.get("annotations", {}).get("org.opencontainers.image.ref.name") for e in entries]
    if tag is not None:
        entries = [e for e, n in zip(entries, names) if n == tag]
    if len(entries) != 1:
        raise PushError(f"{source}: {len(entries)} manifests match; name one as OCI_DIR:TAG "
                        f"(ref.name annotations: {', '.join(map(str, names)) or 'none'})")
    path = blob_path(layout, entries[0]["digest"])
    verify(path, entries[0])
    body = path.read_bytes()
    manifest = json.loads(body)
    media_type = manifest.get("mediaType") or entries[0].get("mediaType")
    if media_type not in MANIFEST_TYPES:
        raise PushError(f"{path}: media type {media_type!r}; push.py pushes one image manifest "
                        f"({', '.join(MANIFEST_TYPES)})")
    try:
        descs = [("config", manifest["config"])]
        descs += [(f"layer {i + 1}/{len(manifest['layers'])}", d) for i, d in enumerate(manifest["layers"])]
        blobs = [(label, d, blob_path(layout, d["digest"])) for label, d in descs]
    except (KeyError, TypeError) as e:
        raise PushError(f"{path}: not an image manifest (no {e})") from None
    for _, d, p in blobs:
        verify(p, d)
    return body, media_type, blobs


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


class Registry:
    def __init__(self, host: str, name: str, plain_http: bool, timeout: float, retries: int):
        self.base = f"{'http' if plain_http else 'https'}://{host}/v2/{name}/"
        self.host, self.name, self.timeout, self.retries = host, name, timeout, retries
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
            return Response(r.status, r.reason, r.headers, r.read())
        finally:
            conn.close()

    def call(self, method: str, url: str, body: bytes = b"", headers: dict | None = None) -> Response:
        """send() with authentication: on 401, log in as the challenge asks (again when a token expired)."""
        headers = dict(headers or {})
        for attempt in (1, 2):
            if self.authorization:
                headers["Authorization"] = self.authorization
            r = self.send(method, url, body, headers)
            if r.status != 401 or attempt == 2:
                break
            self.authenticate(r)
        if r.status == 401:
            who = f"the credentials from {self.login[1]}" if self.login else "anonymous access"
            raise PushError(f"{method} {url}: {r}; {who} refused - {self.hint}")
        return r

    def authenticate(self, r: Response) -> None:
        challenges = r.headers.get_all("WWW-Authenticate") or []
        bearer = next((c for c in challenges if c.lower().startswith("bearer ")), None)
        basic = base64.b64encode(":".join(self.login[0]).encode()).decode() if self.login else None
        if bearer is None:
            if not basic:
                raise PushError(f"{self.host} asks for credentials ({r}), none are stored - {self.hint}")
            self.authorization = f"Basic {basic}"
            return
        params = dict(re.findall(r'(\w+)="([^"]*)"', bearer))
        if "realm" not in params:
            raise PushError(f"{self.host}: a Bearer challenge without a realm: {bearer}")
        query = {"scope": f"repository:{self.name}:pull,push"}
        if "service" in params:
            query["service"] = params["service"]
        realm = params["realm"]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        t = self.send("GET", url, headers={"Authorization": f"Basic {basic}"} if basic else {})
        if t.status != 200:
            who = f"credentials from {self.login[1]}" if self.login else "no credentials (anonymous)"
            raise PushError(f"token from {realm} with {who}: {t} - {self.hint}")
        try:
            reply = json.loads(t.body)
            token = reply.get("token") or reply["access_token"]
        except (ValueError, KeyError, AttributeError):
            raise PushError(f"token from {realm}: no token in the answer: {t.body[:200]!r}") from None
        self.authorization = f"Bearer {token}"

    def failure(self, what: str, r: Response, body_bytes: int = 0) -> PushError:
        if r.status == 413:
            return PushError(f"{what}: 413: request body too large - lower --chunk-bytes (this body was "
                             f"{body_bytes} bytes; {r})")
        return PushError(f"{what}: {r}")

    def has_blob(self, digest: str) -> bool:
        r = self.call("HEAD", self.base + f"blobs/{digest}")
        if r.status not in (200, 404):
            raise self.failure(f"HEAD blob {digest}", r)
        return r.status == 200

    def upload_status(self, location: str) -> tuple[int, int | None]:
        """GET <upload>: its HTTP status (0: no answer) and the N of its `Range: 0-N` (None: not said)."""
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
        r = self.call("POST", self.base + "blobs/uploads/")
        if r.status != 202 or not r.headers.get("Location"):
            raise self.failure(f"{what}: starting an upload", r)
        return urllib.parse.urljoin(self.base, r.headers["Location"])

    def upload(self, label: str, desc: dict, path: Path, chunk: int) -> int:
        """POST, a PATCH per chunk, PUT ?digest=; returns how many PATCH requests were answered 202."""
        digest, size = desc["digest"], desc["size"]
        what = f"{label} {digest}"
        location = self.start_upload(what)
        offset, failures, sent = 0, 0, 0
        alternatives: list[int] = []   # other offsets the registry's last Range may mean, tried on 416
        with path.open("rb") as f:
            while offset < size:
                f.seek(offset)
                data = f.read(min(chunk, size - offset))
                end = offset + len(data) - 1
                try:
                    r = self.call("PATCH", location, data, {"Content-Type": "application/octet-stream",
                                                            "Content-Range": f"{offset}-{end}"})
                except NETWORK_ERRORS as e:
                    answer = f"{type(e).__name__}: {e}"
                else:
                    answer = str(r)
                    if r.status == 202:
                        location = urllib.parse.urljoin(location, r.headers.get("Location") or location)
                        m = re.fullmatch(r"0-(\d+)", r.headers.get("Range", ""))
                        held = int(m.group(1)) + 1 if m else end + 1
                        if not offset < held <= end + 1:
                            raise PushError(f"{what}: after bytes {offset}-{end} the registry reports Range "
                                            f"{r.headers['Range']}")
                        self.learn_status_reading(location, held)
                        offset, failures, alternatives, sent = held, 0, [], sent + 1
                        if size > chunk:
                            print(f"  {label}: {offset}/{size} bytes", flush=True)
                        continue
                    if r.status not in RETRY_STATUS:
                        raise self.failure(f"{what}: bytes {offset}-{end}", r, len(data))
                    if r.status == 416 and alternatives:
                        offset = alternatives.pop(0)
                        continue
                failures += 1
                if failures > self.retries:
                    raise PushError(f"{what} ({path}): the chunk at offset {offset} failed {failures} times, "
                                    f"last answer: {answer} - run push.py again to start this blob over")
                wait = min(2 ** (failures - 1), 30)
                time.sleep(wait)
                failed, offsets = offset, self.resume_offsets(location, size, what)
                if offsets is None:
                    location, offset, alternatives = self.start_upload(what), 0, []
                    going_on = "the registry lost the upload: a new one from byte 0"
                else:
                    offset, *alternatives = offsets or [offset]
                    going_on = f"resuming at byte {offset}" + (
                        f" (or {alternatives[0]} on 416)" if alternatives else "")
                print(f"  {label}: bytes {failed}-{end} failed ({answer}); after {wait}s, {going_on}",
                      flush=True)
        sep = "&" if urllib.parse.urlsplit(location).query else "?"
        r = self.call("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}")
        if r.status != 201:
            raise self.failure(f"{what}: completing the upload", r)
        if r.headers.get("Docker-Content-Digest", digest) != digest:
            raise PushError(f"{what}: the registry stored it as {r.headers['Docker-Content-Digest']}")
        return sent

    def put_manifest(self, tag: str, body: bytes, media_type: str) -> str:
        r = self.call("PUT", self.base + f"manifests/{tag}", body, {"Content-Type": media_type})
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
    body, media_type, blobs = read_image(args.source)
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
    p.add_argument("--plain-http", action="store_true", help="plain HTTP (as CLEFCORE_IMAGE_PUSH_TLS=0)")
    p.add_argument("--retries", type=int, default=5, help="retries of a failed chunk in a row (default 5)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds without progress on a socket (default 300)")
    args = p.parse_args(argv)
    if args.retries < 0 or args.timeout <= 0:
        p.error("--retries must be 0 or more and --timeout more than 0")
    try:
        pushed = push(args)
    except PushError as e:
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
