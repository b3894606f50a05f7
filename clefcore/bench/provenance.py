"""What ran, for the JSON of ``clefcore bench``: the package version, a fingerprint of its sources, the git commit
of its checkout, and whether this process loads cuBLAS and cuBLASLt."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent        # clefcore/, whose code the fingerprint names


def _commit(where: Path) -> str:
    """The git commit of the checkout that holds ``where`` (this package), with "+dirty" when its tree differs;
    "?" when the package is not a tracked file of a checkout (an installed wheel)."""
    def git(*a):
        return subprocess.run(["git", "-C", str(where), *a], capture_output=True, text=True)
    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return "?"
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except OSError:
        return "?"
    return (head or "?") + ("+dirty" if dirty else "")


def _fingerprint(files) -> str:
    """12 hex digits of sha256 over (name, bytes) pairs in name order: the same sources give the same value"""
    h = hashlib.sha256()
    for name, path in sorted(files):
        h.update(name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return h.hexdigest()[:12]


def gemm_libraries() -> dict:
    """Whether this process loads cuBLAS and cuBLASLt, with the reason when not (the JSON's "cublas" and
    "cublaslt"): without cuBLAS every GEMM runs clefcore's own kernels; without cuBLASLt (it comes with cuBLAS)
    there is no split8."""
    from ..backends.cuda import cublas, cublaslt
    missing = cublas.missing()
    if missing is not None:
        lt = dict(loadable=False, error=f"comes with cuBLAS, which cannot be loaded: {missing}")
    elif cublaslt.available():
        lt = dict(loadable=True, error=None)
    else:
        lt = dict(loadable=False, error="libcublasLt not found beside the loaded libcublas nor by its soname")
    return dict(cublas=dict(loadable=missing is None, error=missing), cublaslt=lt)


def code() -> dict:
    """The code that ran: the package version, a fingerprint of its Python modules and kernel sources (it names the code
    where git cannot: an installed wheel, or a copied tree whose .git lags behind it) and the git commit of the
    checkout the package was imported from. The server is left out: it does not run in the bench."""
    from .. import __version__
    from ..backends.cuda.compile import kernel_dir
    files = [(p.relative_to(PACKAGE).as_posix(), p) for p in PACKAGE.rglob("*.py")
             if "server" not in p.relative_to(PACKAGE).parts]
    files += [(f"cuda/{p.name}", p) for p in kernel_dir().glob("*.cu*")]
    return dict(version=__version__, sources=_fingerprint(files), commit=_commit(PACKAGE))
