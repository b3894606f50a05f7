"""Models by Hub id (clefcore/hub.py), resolved from a Hugging Face cache built here as huggingface_hub lays it
out (refs/<name> holding a commit, snapshots/<commit>/<file> linking to blobs/), without the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import clefcore
from clefcore import cli, hub
from clefcore.checkpoint import Checkpoint
from clefcore.errors import CheckpointError
from clefcore.example_request import support_ticket

MODEL = Path(__file__).parent / "golden" / "model"
REPO = "Cloudflare/clef-flash"
MAIN = "a" * 40           # the commit refs/main names
TAGGED = "b" * 40         # the commit refs/v1 names (an older release)
SHARD = "model-00002-of-00002.safetensors"


def add_snapshot(cache: Path, commit: str, refs: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> Path:
    """The golden model as huggingface_hub caches a commit of REPO: each file a blob named by its hash, linked
    from snapshots/<commit>/ (relative links), and each of ``refs`` naming the commit; ``drop``: files left out."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(MODEL.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        if file.name not in drop:
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)   # as huggingface_hub writes it: no newline
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    add_snapshot(cache, MAIN, refs=("main",))
    add_snapshot(cache, TAGGED, refs=("v1", "release/2025"))
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def snapshot_of(cache: Path, commit: str) -> Path:
    return cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


def test_a_hub_id_loads_the_snapshot_refs_main_names(cache):
    engine = clefcore.load(REPO)
    assert engine.checkpoint.path == snapshot_of(cache, MAIN)
    assert engine.model_name == "clef-flash"              # the repository's name, not the commit's
    answer = engine.decide(support_ticket())
    assert answer == clefcore.load(MODEL).decide(support_ticket())


@pytest.mark.parametrize("revision,commit", [("main", MAIN), ("v1", TAGGED), ("release/2025", TAGGED),
                                             (TAGGED, TAGGED)])
def test_a_revision_pins_a_branch_tag_or_commit(cache, revision, commit):
    ck = Checkpoint(REPO, revision)
    assert ck.path == snapshot_of(cache, commit) and ck.name == "clef-flash"
    assert (ck.where.repo_id, ck.where.revision, ck.where.commit) == (REPO, revision, commit)


def test_the_cache_is_found_under_hf_home(cache, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    cache.rename(home / "hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(home))
    assert hub.cache_dir() == home / "hub"
    assert Checkpoint(REPO).path == snapshot_of(home / "hub", MAIN)


def test_the_cache_is_where_huggingface_hub_puts_it(tmp_path):
    """The same answer as huggingface_hub's own constants, for each way of naming the cache."""
    pytest.importorskip("huggingface_hub")
    cases = [{}, {"XDG_CACHE_HOME": "/x/cache"}, {"HF_HOME": "/hf/home", "XDG_CACHE_HOME": "/x/cache"},
             {"HF_HOME": "~/hf"}, {"HF_HOME": "$PLACE/hf", "PLACE": "/data"},
             {"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/hf/home"},
             {"HF_HUB_CACHE": "/mnt/models/hub", "HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/mnt/models"}]
    script = """
import importlib, json, os, sys
import huggingface_hub.constants as constants
from clefcore import hub
out = []
for case in json.loads(sys.argv[1]):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "PLACE"):
        os.environ.pop(name, None)
    os.environ.update(case)
    out.append([str(hub.cache_dir()), importlib.reload(constants).HF_HUB_CACHE])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    pairs = json.loads(done.stdout)
    assert pairs[0][0] == str(tmp_path / ".cache" / "huggingface" / "hub")
    assert pairs[4][0] == "/data/hf/hub" and pairs[-1][0] == "/mnt/models/hub"
    for case, (ours, theirs) in zip(cases, pairs):
        assert ours == theirs, case


def test_a_partial_snapshot_names_the_missing_file(cache, monkeypatch):
    add_snapshot(cache, "c" * 40, refs=("partial",), drop=(SHARD,))
    with pytest.raises(CheckpointError) as missing:
        Checkpoint(REPO, "partial")
    message = missing.value.message
    assert f"{snapshot_of(cache, 'c' * 40) / SHARD}: file not found" in message
    assert f"`clefcore download {REPO} --revision partial`" in message


def test_a_link_to_nowhere_is_missing_too(cache):
    """An interrupted download or a deleted blob leaves a snapshot's link pointing at nothing."""
    snapshot = snapshot_of(cache, MAIN)
    (snapshot / "tokenizer.json").resolve().unlink()
    (snapshot / SHARD).resolve().unlink()
    with pytest.raises(CheckpointError) as missing:
        clefcore.load(REPO)
    assert f"{snapshot / 'tokenizer.json'}: file not found (nor {SHARD})" in missing.value.message
    assert f"{REPO} at main is incomplete, `clefcore download {REPO}` fetches the rest" in missing.value.message


@pytest.mark.parametrize("case,needle", [
    ("no_repo", f"{REPO}: not a directory, and not in the Hugging Face cache"),
    ("no_ref", "revision 'v2' is not in the cache"),
    ("no_snapshot", f"revision 'main' (commit {MAIN}) has no snapshot in the cache"),
    ("bad_ref", "revision '../v1' is not in the cache"),
])
def test_what_the_cache_lacks_is_named(cache, monkeypatch, case, needle):
    revision = {"no_ref": "v2", "bad_ref": "../v1"}.get(case)
    if case == "no_repo":
        monkeypatch.setenv("HF_HUB_CACHE", str(cache.parent / "empty"))
    if case == "no_snapshot":
        snapshot = snapshot_of(cache, MAIN)
        for link in snapshot.iterdir():
            link.unlink()
        snapshot.rmdir()
    with pytest.raises(CheckpointError) as error:
        Checkpoint(REPO, revision)
    assert needle in error.value.message
    if case == "no_ref":
        assert "refs there: main, release/2025, v1" in error.value.message
    if case == "no_snapshot":
        assert f"snapshots there: {TAGGED}" in error.value.message
    assert "`clefcore download " + REPO in error.value.message


def test_a_directory_loads_as_before_and_takes_no_revision(cache):
    ck = Checkpoint(MODEL)
    assert ck.path == MODEL and ck.name == "model" and ck.where.repo_id is None
    with pytest.raises(CheckpointError, match="only a Hub id has revisions"):
        Checkpoint(MODEL, "main")
    assert not hub.is_repo_id("clef-flash") and not hub.is_repo_id("a/b/c") and not hub.is_repo_id("a/--b")


def test_the_command_line_takes_a_hub_id_and_a_revision(cache, tmp_path, capsys):
    request = tmp_path / "request.json"
    request.write_text(json.dumps(support_ticket()))
    add_snapshot(cache, "d" * 40, refs=("broken",), drop=("joint_head.safetensors",))
    assert cli.main(["decide", "--model", REPO, "--revision", "v1", str(request)]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer == clefcore.load(MODEL).decide(support_ticket())
    assert cli.main(["decide", "--model", REPO, "--revision", "broken", str(request)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("clefcore decide: ") and "joint_head.safetensors: file not found" in err


def test_the_service_serves_a_hub_id_at_its_revision(cache):
    """ServiceConfig.revision reaches the device process and the preparer: refs/main names a snapshot without
    its head, so only the tagged one can load."""
    pytest.importorskip("aiohttp")
    from clefcore.server.service import Service, ServiceConfig
    snapshot = snapshot_of(cache, MAIN)
    (snapshot / "joint_head.safetensors").unlink()

    async def main(revision):
        service = Service(ServiceConfig(model=REPO, revision=revision))
        try:
            await service.start()
            return service.status.model_name, await service.decide(support_ticket())
        finally:
            await service.stop()

    name, answer = asyncio.run(main("v1"))
    assert name == "clef-flash"
    assert answer == clefcore.load(MODEL).decide(support_ticket())
    with pytest.raises(CheckpointError, match="joint_head.safetensors: file not found"):
        asyncio.run(main(None))


@pytest.mark.parametrize("held", ["../../../outside", "/abs/outside", "a" * 39 + "/", "A" * 40, "main"])
def test_a_ref_must_hold_a_commit_hash(cache, tmp_path, held):
    """refs/main is used to name the snapshot directory: a path in it would load a model from anywhere (here a
    complete model directory outside the cache, reachable through the ref)."""
    outside = tmp_path / "outside"
    outside.symlink_to(MODEL.resolve())
    held = held.replace("/abs/outside", str(outside))
    (cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text(held)
    with pytest.raises(CheckpointError) as error:
        hub.locate(REPO)
    assert "not a 40-hex commit hash" in error.value.message
    assert repr(held) in error.value.message
