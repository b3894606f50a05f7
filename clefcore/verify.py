"""``clefcore verify --model DIR --device cuda[:N]``: prove a GPU deployment is not silently wrong.

Runs the example request (clefcore/example_request.py) through the GPU path and the fp32 numpy path, prints
per-layer max abs / rel differences of the residual stream, the head logits side by side (and the answers when
``clefcore.engine`` can make them), and exits non-zero when any difference is beyond tolerance. When the
checkpoint has a vision tower (and ``--no-images`` is not given) the same request with an image is packed beside it:
the tower's output is compared too, and the backbone runs both requests in one forward with M-RoPE positions, as the
server packs them. The numpy side streams the backbone from disk but holds the tower in fp32 (1.8 GB on
Clef-flash).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import gpu_settings, precision
from .checkpoint import to_float32
from .device import Device
from .example_request import support_ticket
from .options import DEFAULT_CONTEXT_LENGTH, EngineOptions, HelpFormatter, model_options
from .progress import terminal_bar

# the image of the second request: resized to 320x224 (a real resize), a 7x10 grid of merged tokens (not square)
IMAGE_SIZE = (320, 208)


def image_request() -> dict:
    """The example request with one picture."""
    from .synth import data_url, picture_png
    return dict(support_ticket(), images=[data_url(picture_png(*IMAGE_SIZE))])


def add_arguments(parser):
    model_options(parser)
    parser.add_argument("--device", default="cuda:0", help="the GPU, cuda or cuda:N")
    # the images switch and the GPU options, to check what the deployment serves with
    EngineOptions().add_flags(parser, ("images",) + EngineOptions.GPU)
    parser.add_argument("--layer-tol", type=float, default=None,
                        help="max |gpu-cpu| / max |cpu| per layer "
                             "(default: the precision mode's, 2e-3 exact, 3e-2 fast)")
    parser.add_argument("--prob-tol", type=float, default=None,
                        help="max probability difference (default: the precision mode's contract, 2e-3 exact, "
                             "1e-2 fast)")


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


class _DiskLayer(Mapping):
    """One layer's tensors, read from the checkpoint and widened to fp32 at each access and dropped after
    use, so the fp32 reference never holds the whole model (36 GB for clef-flash) in host memory."""

    def __init__(self, ck, index: int):
        from .model.params import stored_groups
        self.ck, self.prefix = ck, f"layers.{index}."
        groups = stored_groups(n for n in ck.text_tensors if n.startswith(self.prefix))
        self.parts = {n[len(self.prefix):]: parts for n, parts in groups}   # FUSED parts as load_params stacks them

    def __getitem__(self, key):
        ws = [self.ck.text_f32(n) for n in self.parts[key]]
        w = ws[0] if len(ws) == 1 else np.concatenate(ws)
        return w[:, 0, :] if key.endswith("conv1d.weight") else w

    def __iter__(self):
        return iter(self.parts)

    def __len__(self):
        return len(self.parts)


class _DiskTable:
    """A vocabulary table gathered row by row from the checkpoint (``table[ids]``)."""

    def __init__(self, ref):
        self.ref = ref

    def __getitem__(self, ids):
        return to_float32(self.ref, ids)


def streamed_reference_params(ck):
    from .model.params import Params
    p = Params(ck.text, ck.head_config, _DiskTable(ck.text_tensors["embed_tokens.weight"]), ck.text_f32("norm.weight"),
               _DiskTable(ck.text_tensors["lm_head.weight"]), [_DiskLayer(ck, i) for i in range(ck.text.num_layers)])
    p.head = {n: ck.head_f32(n) for n in ck.head_tensors}
    return p


def records(ck, with_image: bool, context_length: int = DEFAULT_CONTEXT_LENGTH) -> list:
    """The encoded requests verify runs, each cut to ``context_length`` as the engine cuts them: the example
    request (clefcore/example_request.py), and with an image the same request with one."""
    from .encode import Encoder
    from .preparer import request_pixels
    from .tokenize import Tokenizer
    from .validate import validate_request
    enc = Encoder(Tokenizer(ck.tokenizer_path))
    bodies = [support_ticket()] + ([image_request()] if with_image else [])
    requests = [validate_request(b, "cloudflare") for b in bodies]
    return [enc.encode(r, context_length, request_pixels(r)) for r in requests]


def _rel(a, b) -> tuple[float, float]:
    d = float(np.max(np.abs(a - b)))
    return d, d / max(float(np.max(np.abs(b))), 1e-30)


def compare(ck, ops, params, layer_tol: float = 2e-3, prob_tol: float = 2e-3, out=print, vision_params=None,
            context_length: int = DEFAULT_CONTEXT_LENGTH) -> bool:
    """Run the example request through ``ops``/``params`` and through the streamed fp32 numpy reference of
    checkpoint ``ck``; with ``vision_params`` (the tower on ``ops``, attached to ``params``: vision.attach)
    the request with an image too, packed beside it; both cut to the engine's ``context_length``. Print the
    side-by-side report; True when the tower, every layer and probability are within tolerance and the answers
    agree."""
    from .backends.cpu import CpuOps
    from .engine import image_inputs, packed_positions
    from .model import vision
    from .model.backbone import backbone
    from .model.head import heads
    recs = records(ck, vision_params is not None, context_length)
    lens = [len(r.input_ids) for r in recs]
    ids = np.concatenate([r.input_ids for r in recs]).astype(np.int64)
    cu, pos = np.concatenate([[0], np.cumsum(lens)]), packed_positions(recs)
    cpu, p_cpu = CpuOps(), streamed_reference_params(ck)
    ok = True
    rows = e_c = e_g = None
    if vision_params is not None:
        p_cpu.mrope_section = params.mrope_section
        rows, e_c = image_inputs(cpu, vision.load_vision(ck, cpu), recs)
        _, e_g = image_inputs(ops, vision_params, recs)
        d, r_ = _rel(ops.to_host(e_g), e_c)
        ok &= r_ <= layer_tol
        _, gh, gw = recs[1].images[0].grid_thw
        out(f"vision tower, one {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} PNG ({gh} x {gw} patches, {len(rows)} image tokens): "
            f"max abs {d:.3e}, max rel {r_:.3e}" + ("" if r_ <= layer_tol else "  <-- beyond tolerance"))
    h_c, kept_c = backbone(cpu, p_cpu, ids, cu, pos, keep_layers=True, image_rows=rows, image_embeds=e_c)
    h_g, kept_g = backbone(ops, params, ids, cu, pos, keep_layers=True, image_rows=rows, image_embeds=e_g)
    what = " + ".join(f"{n} ({'with an image' if r.images else 'text'})" for n, r in zip(lens, recs))
    out(f"{sum(lens)} tokens = {what}; per-layer residual stream, device vs fp32 numpy:")
    out(f"{'layer':>5} {'kind':18} {'max abs':>10} {'max rel':>10}")
    for i, (a, b) in enumerate(zip(kept_g, kept_c)):
        d, r_ = _rel(ops.to_host(a), b)
        flag = "" if r_ <= layer_tol else "  <-- beyond tolerance"
        ok &= r_ <= layer_tol
        out(f"{i:5d} {ck.text.layer_types[i]:18} {d:10.3e} {r_:10.3e}{flag}")
    questions = [r.questions for r in recs]
    z_c = heads(cpu, p_cpu, h_c, ids, cu, questions)
    z_g = heads(ops, params, h_g, ids, cu, questions)
    out("head logits (device | cpu) and probabilities:")
    for rec, zs_g, zs_c in zip(recs, z_g, z_c):
        if len(recs) > 1:
            out(f" request {'with an image' if rec.images else 'text'}:")
        for qi, (zg, zc) in enumerate(zip(zs_g, zs_c)):
            pg, pc = _softmax(zg), _softmax(zc)
            dp = float(np.max(np.abs(pg - pc)))
            same = int(np.argmax(pg)) == int(np.argmax(pc))
            ok &= dp <= prob_tol and same
            flag = "" if dp <= prob_tol and same else "  <-- beyond tolerance"
            out(f"  question {qi}: answer device {int(np.argmax(pg))} cpu {int(np.argmax(pc))}, "
                f"max |dp| {dp:.2e}{flag}")
            for a, b, x, y in zip(zg, zc, pg, pc):
                out(f"      {a:10.5f} | {b:10.5f}    p {x:.5f} | {y:.5f}")
    out("verify: " + ("PASS" if ok else "FAIL"))
    return bool(ok)


def run(args) -> int:
    from .backends.cuda import CudaOps
    from .checkpoint import Checkpoint
    from .model import vision
    from .model.params import load_params
    ck = Checkpoint(args.model, args.revision)
    dev = Device.parse(args.device).index
    options = EngineOptions.from_args(args)
    gpu = CudaOps(dev, **options.gpu())
    bar = terminal_bar(f"loading onto {gpu.ctx.device_name}")
    p_gpu = load_params(ck, gpu, progress=bar)
    vp, why = (None, "--no-images") if not options.images else vision.attach(ck, gpu, p_gpu, progress=bar)
    if vp is None:
        print(f"request with an image: not run ({why})")
    if gpu.fp16_summary():
        print("WARNING:", gpu.fp16_summary())
    layer_bound, prob_bound = precision.VERIFY_BOUND[gpu.mode]
    layer_tol = layer_bound if args.layer_tol is None else args.layer_tol
    prob_tol = prob_bound if args.prob_tol is None else args.prob_tol
    print(f"device: {gpu.ctx.device_name}, precision {gpu.mode} ({gpu.plan.path}), "
          f"gemm {gpu.gemm.pin or gpu_settings.GEMM_AUTO}"
          + ("" if gpu.ctx.cublas_missing is None else " (cuBLAS not loadable: clefcore's own kernels only)")
          + f", bounds: layer {layer_tol:g}, probability {prob_tol:g}")
    return 0 if compare(ck, gpu, p_gpu, layer_tol, prob_tol, vision_params=vp,
                        context_length=options.context_length) else 1


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="clefcore verify", formatter_class=HelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
