"""``clefcore download``: a release's files from the Hugging Face Hub, each checked against the Hub's hashes.

huggingface_hub makes the transfer (the ecosystem's client: the cache layout clefcore/hub.py reads, the progress
bars, and its settings: HF_TOKEN, HF_ENDPOINT, HF_HUB_CACHE, ...). Only the release files clefcore uses are
fetched (checkpoint.RELEASE_FILES). A file already complete is not fetched again, and a connection dropped in the
middle of a file resumes where it stopped (a file cut off by a run that was stopped starts over). Then every file
is hashed and compared with the Hub's listing at the commit fetched (sha256 for LFS files, the git blob hash for
the others); a file that differs is removed, so that the next run fetches it again, and the command fails naming
it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import hub
from .checkpoint import RELEASE_FILES, missing_files
from .errors import CheckpointError, ClefError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="the Hub repository, owner/name (Cloudflare/clef-flash)")
    parser.add_argument("--revision", default=None,
                        help="the branch, tag or commit hash to fetch (default: main)")
    parser.add_argument("--dir", default=None,
                        help="write the files into this directory, a plain model directory (default: the Hugging "
                             "Face cache, where --model OWNER/NAME finds them: $HF_HUB_CACHE, else $HF_HOME/hub, "
                             "else ~/.cache/huggingface/hub)")


def run(args: argparse.Namespace) -> int:
    try:
        import httpx2            # huggingface_hub 2's HTTP client, whose errors its listing calls let through
        import huggingface_hub
    except ImportError:
        raise ClefError("clefcore download needs huggingface_hub: pip install 'clefcore[hub]'") from None
    try:
        _reach(httpx2, args)
        path, commit = _fetch(huggingface_hub, args)
        checked = _check(huggingface_hub.HfApi(), args, path, commit)
    except (OSError, ValueError, httpx2.TransportError) as error:   # the Hub's answers, the network, the disk
        raise ClefError(f"{args.repo_id}: {type(error).__name__}: {error}") from None
    missing = missing_files(path)
    if missing:
        raise CheckpointError(f"{args.repo_id} at commit {commit} has no {', '.join(missing)}: not a clefcore "
                              "release")
    model = args.dir or args.repo_id + ("" if args.revision is None else f" --revision {args.revision}")
    sys.stderr.write(f"clefcore download: {args.repo_id} at commit {commit}, {checked} files match the Hub's "
                     f"hashes; load it with --model {model}\n")
    print(path)
    return 0


REACH_TIMEOUT_S = 3.0   # for each of connecting and the answer; one of them at most takes long


def _reach(httpx2, args: argparse.Namespace) -> None:
    """One request to the Hub, not retried, before the transfer. huggingface_hub retries a Hub it cannot reach for
    about 23 s (and falls back on files already cached); without a network the user hears so at once instead.
    Any answer, 401 and 404 included, means the Hub is there: the transfer reports those itself."""
    from huggingface_hub.constants import ENDPOINT
    from huggingface_hub.utils import get_session
    url = f"{ENDPOINT}/api/models/{args.repo_id}/revision/{args.revision or 'main'}"
    try:
        get_session().get(url, timeout=REACH_TIMEOUT_S)
    except httpx2.TransportError as error:
        raise ClefError(f"cannot reach the Hugging Face Hub at {ENDPOINT} ({type(error).__name__}: "
                        f"{error or 'no answer'}): check the network, a proxy (HTTPS_PROXY) or HF_ENDPOINT") from None


def _fetch(hf, args: argparse.Namespace) -> tuple[Path, str]:
    """The files, and the commit they are of."""
    if args.dir is None:
        # given the revision's name, huggingface_hub also records the commit it names in the cache's refs/, where
        # --model OWNER/NAME looks for it
        path = Path(hf.snapshot_download(args.repo_id, revision=args.revision, cache_dir=hub.cache_dir(),
                                         allow_patterns=list(RELEASE_FILES)))
        return path, path.name               # snapshots/<commit>
    commit = hf.HfApi().repo_info(args.repo_id, revision=args.revision).sha
    return Path(hf.snapshot_download(args.repo_id, revision=commit, local_dir=args.dir,
                                     allow_patterns=list(RELEASE_FILES))), commit


def _check(api, args: argparse.Namespace, path: Path, commit: str) -> int:
    """Every file against the Hub's hashes at ``commit``; those that differ are removed and named. Returns the
    number of files checked."""
    sys.stderr.write(f"clefcore download: checking the files against the Hub's hashes at commit {commit}\n")
    where = {"cache_dir": hub.cache_dir()} if args.dir is None else {"local_dir": path}
    result = api.verify_repo_checksums(args.repo_id, revision=commit, **where)
    for bad in result.mismatches:
        _remove(path / bad["path"])
    if result.mismatches:
        raise CheckpointError(f"{args.repo_id} at commit {commit}: " + "; ".join(
            f"{m['path']} has {m['algorithm']} {m['actual']}, the Hub's is {m['expected']}" for m in result.mismatches)
            + ". Removed: run the download again to fetch it again")
    return result.checked_count


def _remove(file: Path) -> None:
    """A file and, in the cache, the blob it links to (which the next run would link again otherwise)."""
    blob = file.resolve() if file.is_symlink() else None
    file.unlink()
    if blob is not None:
        blob.unlink(missing_ok=True)
