"""``clefcore bench``: kernel microbenchmarks against ceilings measured in the same run, and end-to-end
decisions (backbone + head) at 346 / 2048 / 8192 / 24,576 tokens and 16 x 512 packed.

Without ``--model`` the end-to-end part uses random clef-flash-shaped weights generated directly on the GPU by
the rules ``clefcore synth`` writes its checkpoints by (clefcore/random_weights.py; stored as loading such a
checkpoint stores them: fp16 matrices, vocabulary tables as bf16 on the device); with ``--model DIR`` the
checkpoint is loaded through ``load_params`` (and the load time reported). When torch and transformers import,
a transformers Qwen3.5 text model with the same shapes (bf16, sdpa) runs the same lengths in the same process
(peers.py). Each case reports how many of its GEMM shapes ran on which route (wmma, cublas, rows, mma;
``gemm_routes`` in the JSON); the JSON says whether cuBLAS and cuBLASLt load. Where cuBLAS does not (the lean
image, or PYTHONPATH=tests/no_cublas), the kernel table leaves its cuBLAS rows out.

``--image 1024x1024`` adds the image case: one request with a PNG of that size (1,024 image tokens at
1024x1024) timed end to end, preprocessing (and, separately, decoding) on the host, the vision tower, backbone
and head, against a text-only request of the same length in the same run, interleaved; the ratios go into the
JSON beside the 1.5x target.
The tower is random at the release's shapes without ``--model``, else the checkpoint's (``clefcore synth
--vision`` writes one). Where transformers runs, a Qwen3.5 model with the same text and vision shapes answers the
same request (its image processor on the same PNG, then tower and backbone) and its text twin.

One module per job: this one is the command (flags, the run, the summary); ``timing`` (GPU events, wall clock),
``provenance`` (what ran), ``records`` (the requests), ``kernels`` (the kernel table), ``weights`` (random weights
on the GPU), ``end_to_end`` (the text cases), ``image`` (the image case) and ``peers`` (transformers). The backend
is reached through its public methods only (``CudaOps.gemm_with``, ``plan``, ``twins``, ``gemm``) and its device
context (``CudaOps.ctx``: the GPU's name, capability and switches).
"""

from __future__ import annotations

import json
import platform
import time

from .. import precision
from ..device import Device
from ..options import EngineOptions, HelpFormatter, model_options
from . import end_to_end, image, kernels, provenance
from .peers import transformers_image_side, transformers_side
from .weights import random_params

LENGTHS = (346, 2048, 8192, 24576)


def add_arguments(parser):
    parser.add_argument("--device", default="cuda:0", help="the GPU, cuda or cuda:N")
    model_options(parser, absent="random clef-flash weights, made on the GPU")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="the single-prompt cases' prompt lengths, comma-separated")
    parser.add_argument("--packed", default="16x512",
                        help="the packed case, NxLENGTH: N prompts of LENGTH tokens in one forward")
    parser.add_argument("--precision", dest="precisions", default="fast,exact",
                        help="comma-separated precisions, each timed end to end with its own load (" +
                             ", ".join(precision.CHOICES) + "); the kernel table runs under the first")
    parser.add_argument("--reps", type=int, default=3,
                        help="timed runs of each end-to-end case after a warm-up; the median is reported")
    # the engine's GPU options but --precision, which is a list here (the JSON records those in effect)
    EngineOptions().add_flags(parser, tuple(n for n in EngineOptions.GPU if n != "precision"))
    parser.add_argument("--image", default=None, metavar="WxH",
                        help="also time one request with a WxH PNG (1024x1024: 1,024 image tokens) end to end "
                             "against a text-only request of the same length, per precision (default: off)")
    parser.add_argument("--breakdown", type=int, default=0, metavar="TOKENS",
                        help="for cases of up to this many tokens, also time the backbone and the joint head apart, "
                             "and the head's host (launch) time, over a series of requests of the case's question "
                             "schema whose states differ in length (within its 128-token bucket), as one client "
                             "sends them; 0: off")
    parser.add_argument("--no-kernels", action="store_true", help="leave out the kernel table")
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave out transformers' runs of the same cases")
    parser.add_argument("--json", default=None, help="write all numbers to this file (default: printed only)")


def _summary(out) -> list[dict]:
    """Each case: every precision's time and its ratio to transformers in the same run (> 1: clefcore faster)."""
    tf = out.get("transformers")
    tf_ms = ({r["case"].replace("padded batch", "packed"): r["ms"] for r in tf["results"]}
             if isinstance(tf, dict) else {})
    rows = []
    first = next(iter(out["end_to_end"].values()))
    for i, r in enumerate(first):
        row = dict(case=r["case"], tokens=r["tokens"], transformers_ms=tf_ms.get(r["case"]))
        for prec, res in out["end_to_end"].items():
            row[f"{prec}_ms"] = res[i]["ms"]
            if row["transformers_ms"]:
                row[f"{prec}_speedup"] = row["transformers_ms"] / res[i]["ms"]
        rows.append(row)
        print("  " + r["case"].ljust(16) + "".join(
            f"  {p} {row[f'{p}_ms']:8.1f} ms" + (f" ({row[f'{p}_speedup']:.2f}x)" if f"{p}_speedup" in row else "")
            for p in out["end_to_end"]) + (f"  transformers {row['transformers_ms']:8.1f} ms"
                                           if row["transformers_ms"] else ""))
    return rows


def run(args) -> int:
    import cupy as cp

    from ..backends.cuda import CudaOps
    from ..config import HeadConfig, TextConfig
    dev = Device.parse(args.device).index
    precisions = [p for p in args.precisions.split(",") if p]
    options = EngineOptions.from_args(args)
    for p in precisions:
        precision.resolve(p, False)      # an unknown name fails here, before any load
    lengths = [int(v) for v in args.lengths.split(",") if v]
    image_size = image.parse_size(args.image) if args.image else None
    out = dict(date=time.strftime("%Y-%m-%d"), **provenance.code(), **provenance.gemm_libraries(),
               host=platform.node(), precisions=precisions, end_to_end={}, paths={}, gemm_choice={}, weights_gib={},
               load_s={})
    if image_size:
        out.update(image={}, vision_weights_gib={})
    text_cfg = vision_cfg = section = ck = None
    for i, prec in enumerate(precisions):
        ops = CudaOps(dev, tables="device", **dict(options.gpu(), precision=prec))
        gpu = ops.ctx
        out.update(device=gpu.device_name, token_block=ops.token_block, graph_tokens=ops.graphs.max_tokens)
        out["kernel_switches"] = sorted(s.name for s in gpu.switches)
        out["paths"][prec] = ops.plan.path
        print(f"clefcore bench on {gpu.device_name} (cc {gpu.cc[0]}.{gpu.cc[1]}): clefcore {out['version']}, sources "
              f"{out['sources']}, commit {out['commit']}; precision {prec} ({ops.plan.path}), token block "
              f"{ops.token_block}, CUDA graphs up to {ops.graphs.max_tokens} tokens"
              + ("" if gpu.cublas_missing is None else "; cuBLAS not loadable: own GEMM kernels"))
        if i == 0 and not args.no_kernels:
            print(f"kernels (under {prec}):")
            out["kernels_precision"] = prec
            kernels.table(cp, ops, out)
        t0 = time.perf_counter()
        if args.model:
            from ..checkpoint import Checkpoint
            from ..model.params import load_params
            ck = Checkpoint(args.model, args.revision)
            params = load_params(ck, ops)
            text_cfg = ck.text
        else:
            from ..synth import PRESETS, config_json
            text_cfg = TextConfig.from_dict(config_json("clef-flash", vision=False))
            params = random_params(cp, ops, text_cfg, HeadConfig(**PRESETS["clef-flash"]["head"]))
        cp.cuda.Device().synchronize()
        load_s = time.perf_counter() - t0
        wbytes = cp.get_default_memory_pool().used_bytes()
        out["load_s"][prec] = load_s
        out["weights_gib"][prec] = wbytes / 2 ** 30
        print(f"weights: {wbytes / 2 ** 30:.2f} GiB on the GPU, {'loaded' if args.model else 'generated'} in "
              f"{load_s:.1f} s")
        print(f"end to end, {prec} (backbone + head, in-process):")
        out["end_to_end"][prec] = end_to_end.text_cases(cp, ops, params, lengths, args.packed, args.reps,
                                                        args.breakdown)
        if image_size:
            vp = image.tower(cp, ops, params, ck)
            vision_cfg = vp.config
            out["vision_weights_gib"][prec] = (cp.get_default_memory_pool().used_bytes() - wbytes) / 2 ** 30
            print(f"image case, {prec} (decode + preprocess + tower + backbone + head; vision tower "
                  f"{out['vision_weights_gib'][prec]:.2f} GiB on the GPU):")
            out["image"][prec] = image.case(cp, ops, params, vp, image_size, args.reps)
            section = params.mrope_section
            del vp
        out["gemm_choice"][prec] = {f"N={k[0]} K={k[1]} M~{k[2]} {k[3]}": v.value
                                    for k, v in ops.gemm.chosen.items()}
        print("gemm autotune choices:", json.dumps(out["gemm_choice"][prec]))
        del params, ops
        cp.get_default_memory_pool().free_all_blocks()
    if not args.no_transformers:
        print("transformers (same shapes, random bf16 weights):")
        if lengths or args.packed:
            transformers_side(text_cfg, lengths, args.packed, args.reps, out)
        if image_size:
            transformers_image_side(text_cfg, vision_cfg, section, image_size, args.reps, out)
    print("summary (speedup = transformers' time / clefcore's, same run):")
    out["summary"] = _summary(out)
    for prec, r in out.get("image", {}).items():
        print(f"  image {r['image']}, {r['tokens']} tokens  {prec}: {r['ratio']:.2f}x the text-only request's time "
              f"(fastest runs {r['ratio_fastest']:.2f}x; target {image.TARGET}x: "
              f"{'met' if r['within_target'] else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="clefcore bench", formatter_class=HelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))
