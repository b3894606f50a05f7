"""Every kernel file in cuda/ compiles on its own for Volta (compute_70 PTX, sm_70 cubin) and Hopper (sm_90)
with NVRTC 12 from pip (nvidia-cuda-nvrtc-cu12), no GPU needed, no defines given and no CUDA toolkit's headers
on the include path; no kernel may spill to local memory."""

import re

import pytest

from clefcore.backends.cuda import compile as C

try:
    NV = C.nvrtc()
except C.NvrtcError as e:          # pragma: no cover - CI installs the wheel (the `test` extra)
    NV = None
    REASON = str(e)

pytestmark = pytest.mark.skipif(NV is None, reason="pip NVRTC 12 missing")

FILES = [p.name for p in C.kernel_files()]


def test_every_family_present():
    for f in ("gemm.cu", "norms.cu", "rotary.cu", "attention.cu", "conv1d.cu", "gated_delta_wy.cu", "embed.cu",
              "vision.cu"):
        assert f in FILES


@pytest.mark.parametrize("name", FILES)
def test_compute_70_ptx(name):
    c = C.compile_file(name, "compute_70")
    assert b".target sm_70" in c.image
    assert "error" not in c.log.lower()


@pytest.mark.parametrize("target", ["sm_70", "sm_90"])
@pytest.mark.parametrize("name", FILES)
def test_cubin_and_spills(name, target):
    c = C.compile_file(name, target)
    assert len(c.image) > 0
    rep = C.ptxas_report(c.log)
    assert rep, f"no ptxas report for {name} {target}:\n{c.log}"
    # every kernel, not a list of hot ones: the list had gone stale (it missed the split GEMMs, the V100's
    # default path, and attn_fwd_d256 on sm_90), and a spill anywhere is a performance bug worth a failed build
    for k, r in rep.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{k} spills on {target}: {r}"


def test_wgmma_builds_for_sm_90a():
    """gemm_wgmma.cu's body exists only for sm_90a (the other targets above build it empty): its kernels (the
    plain GEMM and the fused_elementwise switch's gate/up + SwiGLU one) must compile there, with their 128
    accumulators a thread in registers and nothing spilled."""
    rep = C.ptxas_report(NV.compile(C.source("gemm_wgmma.cu"), "gemm_wgmma.cu", "sm_90a").log)
    for name in ("gemm_wgmma_f16a", "gemm_wgmma_swiglu"):
        r = rep[name]
        assert r["registers"] >= 128 and r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r


def test_attention_wgmma_builds_for_sm_90a():
    """attention_wgmma.cu's body exists only for sm_90a: its kernel must compile there with its accumulators in
    registers (O alone is 128 a thread), nothing spilled, and no wgmma serialized by ptxas (which it does, with a
    "Potential Performance Loss" note, when the MMAs or their registers sit on a path that may differ within a
    warpgroup)."""
    c = NV.compile(C.source("attention_wgmma.cu"), "attention_wgmma.cu", "sm_90a")
    r = C.ptxas_report(c.log)["attn_wgmma_fwd_d256"]
    print(f"attn_wgmma_fwd_d256 on sm_90a: {r}")
    assert 128 < r["registers"] <= 255, r
    assert r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    assert "Performance Loss" not in c.log and "serialized" not in c.log, c.log


def _instructions(ptx: bytes) -> list[str]:
    """A PTX image less its comments and its .target line."""
    return [line for line in ptx.decode(errors="replace").splitlines()
            if not line.startswith((".target", "//"))]


@pytest.mark.parametrize("name", [*sorted(C._SM90A), "rotary.cu"])
def test_only_the_sm_90a_files_have_sm_90a_code(name):
    """The files the run-time loader builds with -arch=sm_90a have their kernels' bodies only there: their
    compute_90 PTX is shorter than their compute_90a PTX. A file written for every GPU (rotary.cu) builds the
    same for both, so the comparison can fail."""
    plain, hopper = (_instructions(NV.compile(C.source(name), name, target).image)
                     for target in ("compute_90", "compute_90a"))
    assert len(plain) < len(hopper) if name in C._SM90A else plain == hopper


def test_attention_entry_points_match_the_host():
    """attention.cu defines exactly the kernels attention.py launches: attn_fwd_d{D} for CAUSAL_DIMS, attn_bidir_d{D}
    for BIDIR_DIMS (the vision tower's 72 among them) and attn_launch_d{D} for both; attention_wgmma.cu its
    attn_wgmma_fwd_d{D} and attn_wgmma_launch_d{D} for WGMMA_DIMS."""
    from clefcore.backends.cuda.attention import BIDIR_DIMS, CAUSAL_DIMS
    from clefcore.kernel_select import ATTN, ATTN_WGMMA, WGMMA_DIMS
    entries = set(re.findall(r"\.entry (\w+)\(", C.ptx70_path(ATTN.file).read_text()))
    assert "attn_fwd_d256" in entries and "attn_launch_d72" in entries     # the names as written in the file
    dims = {"fwd": CAUSAL_DIMS, "bidir": BIDIR_DIMS, "launch": set(CAUSAL_DIMS) | set(BIDIR_DIMS)}
    assert entries == {ATTN.name(kind, d) for kind in dims for d in dims[kind]}
    entries = set(re.findall(r"\.entry (\w+)\(", C.ptx70_path(ATTN_WGMMA.file).read_text()))
    assert entries == {ATTN_WGMMA.name(kind, d) for d in WGMMA_DIMS for kind in ("fwd", "launch")}
