"""`clefcore download` against a stand-in for the Hugging Face Hub on loopback (HF_ENDPOINT), no network. The
stand-in answers the requests huggingface_hub's download path makes (StandInHub says which), LFS files through a
storage host on another origin. Its tokenizer.json is padded to 16 MiB: huggingface_hub writes in 10 MiB
pieces, so only a longer file can be resumed partway.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("huggingface_hub", reason="clefcore download needs huggingface_hub (pip install clefcore[hub])")

import clefcore  # noqa: E402
from clefcore.checkpoint import Checkpoint  # noqa: E402
from test_cli_errors import one_line  # noqa: E402

MODEL = Path(__file__).parent / "golden" / "model"
REPO = "Cloudflare/clef-flash"
COMMIT = "c" * 40          # main
TAGGED = "d" * 40          # v1
SHARD = "model-00002-of-00002.safetensors"
BIG = 16 * 2**20           # tokenizer.json's size on the stand-in
RELEASE = {"config.json", "joint_head_config.json", "tokenizer.json", "tokenizer_config.json",
           "joint_head.safetensors", "model.safetensors.index.json", "model-00001-of-00002.safetensors", SHARD}
LFS = (".safetensors", "tokenizer.json")   # stored in LFS on the stand-in, as large files are on the Hub


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class StandInHub:
    """The Hub's download API for one repository whose every commit holds ``files``, on two loopback origins:
    the Hub itself and the storage host LFS files redirect to. ``served`` is what GET returns (a test may make it
    differ from ``files``, whose hashes the listing and the metadata give); the first GET of a file in
    ``cut_once`` sends the number of bytes it maps the file to and drops the connection. ``log`` records
    (method, path, Range)."""

    def __init__(self, files: dict[str, bytes], refs: dict[str, str]):
        self.files, self.served, self.refs = files, dict(files), refs
        self.cut_once: dict[str, int] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        self.by_sha = {hashlib.sha256(d).hexdigest(): n for n, d in files.items()}
        self.hub = self._server()
        self.storage = self._server()

    def _server(self) -> ThreadingHTTPServer:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                stand_in.answer(self, body=False)

            def do_GET(self):
                stand_in.answer(self, body=True)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    @staticmethod
    def url(server: ThreadingHTTPServer) -> str:
        return f"http://127.0.0.1:{server.server_address[1]}"

    def close(self) -> None:
        for server in (self.hub, self.storage):
            server.shutdown()
            server.server_close()

    def requests(self, method: str) -> list[tuple[str, str | None]]:
        with self.lock:
            return [(path, byte_range) for m, path, byte_range in self.log if m == method]

    # --- the routes --------------------------------------------------------------------------------------
    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self.lock:
            self.log.append((h.command, path, h.headers.get("Range")))
        api = f"/api/models/{REPO}/"
        if h.server is self.storage and path.startswith("/blobs/") and path[7:] in self.by_sha:
            return self.content(h, self.by_sha[path[7:]], body)
        if h.server is not self.hub:
            return self.send(h, 404, {}, b"")
        if path.startswith(api + "revision/"):
            commit = self.commit(path[len(api + "revision/"):])
            if commit is None:
                return self.send(h, 404, {"X-Error-Code": "RevisionNotFound"}, b'{"error": "Invalid rev id"}')
            return self.json(h, {"id": REPO, "sha": commit, "private": False,
                                 "siblings": [{"rfilename": n} for n in self.files]})
        if path.startswith(api + "tree/"):
            if self.commit(path[len(api + "tree/"):]) is None:
                return self.send(h, 404, {"X-Error-Code": "RevisionNotFound"}, b"{}")
            return self.json(h, [self.entry(n) for n in sorted(self.files)])
        prefix = f"/{REPO}/resolve/"
        if path.startswith(prefix):
            revision, _, name = path[len(prefix):].partition("/")
            commit = self.commit(revision)
            if commit is None or name not in self.files:
                return self.send(h, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit or ""}, b"")
            data = self.files[name]
            if name.endswith(LFS):
                sha = hashlib.sha256(data).hexdigest()
                return self.send(h, 302, {"Location": f"{self.url(self.storage)}/blobs/{sha}",
                                          "X-Repo-Commit": commit, "X-Linked-Etag": f'"{sha}"',
                                          "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_id(data)}"'}, b"")
            return self.content(h, name, body, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"'})
        self.send(h, 404, {"X-Error-Code": "RepoNotFound"}, b"")

    def commit(self, revision: str) -> str | None:
        return revision if revision in self.refs.values() else self.refs.get(revision)

    def entry(self, name: str) -> dict:
        data = self.files[name]
        entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
        if name.endswith(LFS):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def content(self, h, name: str, body: bool, headers: dict | None = None) -> None:
        data = self.served[name]
        start = 0
        headers = dict(headers or {})
        byte_range = h.headers.get("Range")
        if byte_range:
            start = int(byte_range.removeprefix("bytes=").split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        with self.lock:
            cut = self.cut_once.pop(name, None) if body else None
        if cut is None:
            return self.send(h, 206 if byte_range else 200, headers, data[start:], body)
        h.send_response(200)                  # the whole file announced, part of it sent
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(data[:cut])
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)

    def json(self, h, value) -> None:
        self.send(h, 200, {"Content-Type": "application/json"}, json.dumps(value).encode())

    @staticmethod
    def send(h, status: int, headers: dict, data: bytes, body: bool = True) -> None:
        h.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(key, value)
        h.end_headers()
        if body and h.command != "HEAD":
            h.wfile.write(data)


@pytest.fixture
def stand_in():
    files = {p.name: p.read_bytes() for p in sorted(MODEL.iterdir())}
    files["tokenizer.json"] += b" " * (BIG - len(files["tokenizer.json"]))
    hub = StandInHub(files, {"main": COMMIT, "v1": TAGGED})
    yield hub
    hub.close()


@pytest.fixture
def env(tmp_path, stand_in):
    """The download's environment: the stand-in as the Hub, a cache and a home of its own, no token, no proxy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(HF_ENDPOINT=stand_in.url(stand_in.hub), HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1",
               COLUMNS="120")
    return env


def download(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clefcore.cli", "download", REPO, *args], capture_output=True,
                          text=True, env=env, cwd="/", timeout=180)


def snapshot(env: dict, commit: str = COMMIT) -> Path:
    return Path(env["HF_HUB_CACHE"]) / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


def test_download_into_the_cache_resumes_a_dropped_file_and_loads_by_hub_id(stand_in, env, monkeypatch):
    stand_in.cut_once["tokenizer.json"] = 12 * 2**20
    done = download(env)
    assert done.returncode == 0, done.stderr
    path = snapshot(env)
    assert done.stdout.strip() == str(path)
    assert "8 files match the Hub's hashes" in done.stderr and "Fetching 8 files" in done.stderr   # the bar
    assert {p.name for p in path.iterdir()} == RELEASE                  # not generation_ or processor_config
    for name in RELEASE:
        assert (path / name).read_bytes() == stand_in.files[name], name
    assert (path.parent.parent / "refs" / "main").read_text() == COMMIT
    sha = hashlib.sha256(stand_in.files["tokenizer.json"]).hexdigest()
    first, again = [r for p, r in stand_in.requests("GET") if p == f"/blobs/{sha}"]
    assert first is None and again.startswith("bytes=") and again.endswith("-")
    assert 0 < int(again[6:-1]) <= 12 * 2**20                          # resumed from what it had kept
    monkeypatch.setenv("HF_HUB_CACHE", env["HF_HUB_CACHE"])
    assert Checkpoint(REPO).path == path


def test_a_file_that_differs_from_the_hubs_hash_is_named_removed_and_fetched_again(stand_in, env, monkeypatch):
    good = stand_in.served[SHARD]
    stand_in.served[SHARD] = good[:-16] + bytes(16)                   # same size, other bytes
    done = download(env)
    assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr
    error = done.stderr.splitlines()[-1]          # after the progress bars
    assert error.startswith(f"clefcore download: {REPO} at commit {COMMIT}: ")
    sha = hashlib.sha256(good).hexdigest()
    assert f"{SHARD} has sha256 {hashlib.sha256(stand_in.served[SHARD]).hexdigest()}, the Hub's is {sha}" in error
    path = snapshot(env)
    assert not (path / SHARD).exists() and not (path / SHARD).is_symlink()
    assert not (path.parent.parent / "blobs" / sha).exists()
    monkeypatch.setenv("HF_HUB_CACHE", env["HF_HUB_CACHE"])
    with pytest.raises(clefcore.CheckpointError, match=f"{SHARD}: file not found"):
        Checkpoint(REPO)

    stand_in.served[SHARD] = good
    stand_in.log.clear()
    done = download(env)
    assert done.returncode == 0, done.stderr
    assert [p for p, _ in stand_in.requests("GET") if not p.startswith("/api/")] == [f"/blobs/{sha}"]
    assert (path / SHARD).read_bytes() == good
    Checkpoint(REPO)


def test_download_into_a_directory_at_a_tag(stand_in, env, tmp_path):
    target = tmp_path / "clef-flash"
    done = download(env, "--revision", "v1", "--dir", str(target))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    assert {p.name for p in target.iterdir() if p.name != ".cache"} == RELEASE
    assert f"{REPO} at commit {TAGGED}" in done.stderr
    heads = [p for p, _ in stand_in.requests("HEAD")]
    assert heads and all(p.startswith(f"/{REPO}/resolve/{TAGGED}/") for p in heads)   # the tag's commit, pinned
    assert not Path(env["HF_HUB_CACHE"]).exists()
    assert clefcore.load(target).model_name == "clef-flash"


def test_an_unknown_revision_is_a_message(env):
    message = one_line(download(env, "--revision", "v9"))
    assert message.startswith(f"clefcore download: {REPO}: RevisionNotFoundError") and "v9" in message


def test_an_unreachable_hub_is_one_line_within_5_s_even_with_the_files_cached(env):
    """huggingface_hub retries a Hub it cannot reach for about 23 s and falls back on the cache; the command says
    at once that the Hub cannot be reached: nothing listens at the address, or something accepts and never
    answers (a network that drops packets)."""
    assert download(env).returncode == 0
    with socket.socket() as free, socket.socket() as silent:
        free.bind(("127.0.0.1", 0))
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        for server in (free, silent):
            env["HF_ENDPOINT"] = f"http://127.0.0.1:{server.getsockname()[1]}"
            start = time.monotonic()
            done = download(env)
            took = time.monotonic() - start
            assert took < 5, (took, done.stderr)
            assert one_line(done).startswith("clefcore download: cannot reach the Hugging Face Hub at "
                                             f"{env['HF_ENDPOINT']} (")


def test_without_huggingface_hub_it_says_what_to_install(env):
    script = ("import sys; sys.modules['huggingface_hub'] = None\n"
              "from clefcore import cli; sys.exit(cli.main(['download', 'Cloudflare/clef-flash']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert "pip install 'clefcore[hub]'" in one_line(done)
