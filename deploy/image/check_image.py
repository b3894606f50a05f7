"""Run inside the built image (build.sh copies it to /tmp and runs it as user 10001 with networking off).

    python3 /tmp/check_image.py --cublas yes|no

Fails (exit 1) unless: the user is not root, the network is unreachable, the compile caches point into the
writable /cache, every module the server imports loads from current bytecode, NVRTC loads from the wheels
(CuPy's binding and clefcore's offline compiler, which builds one kernel for sm_70), `clefcore demo` answers every
question of its request, and cuBLAS is as the variant says:
- yes (the full image): CuPy's cuBLAS binding imports, and libcublas and libcublasLt open from the image's
  wheel, which is the condition under which the engine runs its GEMMs through them on a GPU
  (clefcore.backends.cuda.cublas.missing() is None, cublaslt.available());
- no (the lean image): no cuBLAS library is in the image and importing CuPy and clefcore loads none.
Standard library plus what the image installs; no GPU needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def reachable(host: str, port: int) -> str | None:
    """None when no connection can be made; otherwise what answered."""
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            return str(s.getpeername())
    except OSError:
        return None


def cublas_libraries() -> list[str]:
    found = set()   # the roots overlap (the venv is under /opt)
    for root in (Path(sys.prefix), Path("/usr/lib"), Path("/usr/local/lib"), Path("/opt")):
        if root.is_dir():
            found |= {str(p) for p in root.rglob("libcublas*")}
    return sorted(found)


def loaded(name: str) -> list[str]:
    """Paths of the loaded shared objects whose file name starts with ``name``."""
    maps = Path("/proc/self/maps").read_text()
    return sorted({line.split()[-1] for line in maps.splitlines() if Path(line.split()[-1]).name.startswith(name)})


def main() -> int:
    p = argparse.ArgumentParser(description="checks run inside the serving image")
    p.add_argument("--cublas", choices=("yes", "no"), required=True, help="whether the image ships cuBLAS")
    with_cublas = p.parse_args().cublas == "yes"
    check("runs as a non-root user", os.getuid() != 0, f"uid {os.getuid()}")

    for host, port in (("pypi.org", 443), ("1.1.1.1", 443), ("8.8.8.8", 53)):
        peer = reachable(host, port)
        check(f"network off ({host}:{port} unreachable)", peer is None, peer or "")

    # the manifests mount a volume at /cache over a read-only root: every compile cache must be in it
    for var in ("CUPY_CACHE_DIR", "CUDA_CACHE_PATH", "CLEFCORE_KERNEL_CACHE"):
        path = Path(os.environ.get(var) or "/nonexistent")
        existing = next(p for p in (path, *path.parents) if p.exists())
        check(f"{var} under /cache and writable", path.is_relative_to("/cache") and os.access(existing, os.W_OK),
              f"{path} ({existing} exists)")

    files = cublas_libraries()
    import cupy
    import clefcore
    import clefcore.backends.cuda.ops  # noqa: F401  (the GPU backend, as `serve --device cuda` imports it)
    import clefcore.server  # noqa: F401
    if with_cublas:
        check("libcublas and libcublasLt in the image",
              any("/libcublas.so" in f for f in files) and any("/libcublasLt.so" in f for f in files),
              ", ".join(files))
        from clefcore.backends.cuda import cublas, cublaslt
        why = cublas.missing()   # imports CuPy's cuBLAS binding, which opens libcublas (and libcublasLt with it)
        check("CuPy's cuBLAS binding imports", why is None, why or "")
        check("cuBLASLt opens (clefcore's binding)", cublaslt.available())
        both = loaded("libcublas.so") + loaded("libcublasLt.so")
        check("both libraries opened from the image's wheel",
              len(both) == 2 and all(f.startswith(sys.prefix) for f in both), ", ".join(both))
    else:
        check("no cuBLAS library in the image", not files, ", ".join(files))
        opened = loaded("libcublas")
        check("import cupy / clefcore loads no cuBLAS", not opened, ", ".join(opened))
    from cupy.cuda import nvrtc
    version = nvrtc.getVersion()
    check("CuPy loads NVRTC 12 from the wheel", version[0] == 12, f"CuPy {cupy.__version__}, NVRTC {version}")

    from clefcore.backends.cuda import compile as kc
    files = kc.kernel_files()
    check("kernel sources installed", bool(files), str(kc.kernel_dir()))
    if files:
        smallest = min(files, key=lambda p: p.stat().st_size)
        t = time.perf_counter()
        try:
            c = kc.compile_file(smallest.name, "sm_70")
            check("clefcore compiles a kernel for sm_70 offline", len(c.image) > 0,
                  f"{smallest.name}, {len(c.image)} bytes of cubin in {time.perf_counter() - t:.1f} s")
        except Exception as e:  # noqa: BLE001 - the message is the report
            check("clefcore compiles a kernel for sm_70 offline", False, f"{type(e).__name__}: {e}")

    # every module the server imports loads from bytecode that is current: the root filesystem is read-only to
    # this user, so a stale or missing .pyc would mean compiling from source at every start
    verbose = subprocess.run([sys.executable, "-v", "-c", "import clefcore.server, clefcore.backends.cuda.ops"],
                             capture_output=True, text=True, timeout=300)
    from_source = [line.split()[-1] for line in verbose.stderr.splitlines()
                   if line.startswith("# code object from ") and line.rstrip().endswith(".py")]
    check("every imported module loads from current bytecode", verbose.returncode == 0 and not from_source,
          f"exit {verbose.returncode}, compiled from source: {', '.join(from_source[:5])}"
          + (f" and {len(from_source) - 5} more" if len(from_source) > 5 else ""))

    exe = shutil.which("clefcore")
    check("clefcore on PATH", exe is not None, exe or "")
    t = time.perf_counter()
    run = subprocess.run([exe or "clefcore", "demo"], capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t
    sys.stderr.write(run.stderr[-2000:])
    answered = False
    detail = f"exit {run.returncode} in {took:.1f} s"
    if run.returncode == 0:
        out = json.loads(run.stdout)
        asked = set(out["request"]["questions"])
        answers = out["response"].get("answers", {})
        answered = bool(asked) and set(answers) == asked and all(
            answers[q].get("type") == out["request"]["questions"][q]["type"] for q in asked)
        detail += f", {len(answers)}/{len(asked)} questions answered"
    check("clefcore demo answers offline", answered, detail)

    if failures:
        print(f"{len(failures)} check(s) failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
