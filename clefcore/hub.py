"""Where a ``--model`` value's files are: a directory as given, or a Hugging Face Hub id (``Cloudflare/clef-flash``)
found in the local Hugging Face cache, without the network.

The cache is the one huggingface_hub writes (``clefcore download``, ``hf download``, vLLM, SGLang): under its
root, ``models--<owner>--<name>/refs/<branch or tag>`` holds a commit hash and ``snapshots/<commit>/`` the files
of that commit. Reading it takes two small files, so the server needs no huggingface_hub; its environment
variables are read as huggingface_hub reads them (tests/test_hub.py holds the two to the same answer).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

DEFAULT_REVISION = "main"
# owner/name as the Hub spells repository ids; a bare name or anything with more slashes is a directory
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ModelDir:
    """A model's directory and what it was found as. For a Hub id: the repository, the revision asked for and
    the commit it named when it was resolved; all None for a directory given as such."""

    path: Path
    name: str                        # the model's name: the directory's, or the repository's (clef-flash)
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def incomplete(self) -> str:
        """What to say of files missing here: for a Hub id's snapshot, the download that fetches them ("" for a
        directory given as such)."""
        if self.repo_id is None:
            return ""
        return f"{self.repo_id} at {self.revision} is incomplete, {_fetch(self.repo_id, self.revision)} fetches " \
               "the rest"


def cache_dir() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else the older $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (read when called, not at import)."""
    env = os.environ
    home = _expand(env.get("HF_HOME", os.path.join(env.get("XDG_CACHE_HOME", os.path.join(
        os.path.expanduser("~"), ".cache")), "huggingface")))
    return Path(_expand(env.get("HF_HUB_CACHE", env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))))


def _expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def is_repo_id(model: str) -> bool:
    return bool(_REPO_ID.fullmatch(model)) and "--" not in model and ".." not in model


def locate(model: str | Path, revision: str | None = None) -> ModelDir:
    """The directory ``model`` names: an existing directory as it is (``revision`` must be None), else a Hub id's
    snapshot in the cache at ``revision`` (a branch, tag or commit hash; default: the cache's ``main`` ref).
    Checks nothing inside the directory (the Checkpoint does)."""
    path = Path(model)
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"revision {revision!r}: only a Hub id has revisions, and {model} is a directory")
        return ModelDir(path, path.resolve().name)
    if not is_repo_id(str(model)):
        raise CheckpointError(f"{model}: model directory not found (nor is it a Hub id, owner/name)")
    return snapshot(str(model), revision or DEFAULT_REVISION)


def snapshot(repo_id: str, revision: str) -> ModelDir:
    """A Hub repository's snapshot directory in the cache at ``revision``; a CheckpointError says what is missing:
    the repository, the ref or the snapshot (the files in it are the Checkpoint's to check)."""
    cache = cache_dir()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    fetch = _fetch(repo_id, revision)
    if not repo.is_dir():
        raise CheckpointError(f"{repo_id}: not a directory, and not in the Hugging Face cache {cache} (no "
                              f"{repo.name}); {fetch} fetches it")
    if _COMMIT.fullmatch(revision):
        commit = revision
    else:
        ref = repo / "refs" / revision
        if any(part in ("", ".", "..") for part in revision.split("/")) or not ref.is_file():
            refs = repo / "refs"
            known = sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file())
            raise CheckpointError(f"{repo_id}: revision {revision!r} is not in the cache (no {ref}; refs there: "
                                  f"{', '.join(known) or 'none'}); {fetch} fetches it")
        commit = ref.read_text(encoding="utf-8", errors="replace").strip()
        if not _COMMIT.fullmatch(commit):   # used as a path below: only a commit hash may name the snapshot
            raise CheckpointError(f"{repo_id}: ref {ref} holds {commit[:80]!r}, not a 40-hex commit hash; "
                                  f"{fetch} writes it anew")
    path = repo / "snapshots" / commit
    if not path.is_dir():
        snapshots = repo / "snapshots"
        known = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
        raise CheckpointError(f"{repo_id}: revision {revision!r} (commit {commit}) has no snapshot in the cache "
                              f"(no {path}; snapshots there: {', '.join(known) or 'none'}); {fetch} fetches it")
    return ModelDir(path, repo_id.split("/")[1], repo_id, revision, commit)


def _fetch(repo_id: str, revision: str) -> str:
    return f"`clefcore download {repo_id}" + ("" if revision == DEFAULT_REVISION else f" --revision {revision}") + "`"
