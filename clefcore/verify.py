"""``clefcore verify --model DIR --device cuda[:N]``: prove a GPU deployment is not silently wrong.

Runs a short built-in request through the GPU path and the fp32 numpy path, prints per-layer max abs / rel
differences of the residual stream, the head logits side by side (and the answers when ``clefcore.engine``
can make them), and exits non-zero when any difference is beyond tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import precision
from .checkpoint import to_float32
from .progress import terminal_bar

REQUEST = {
    "model": "clef-flash",
    "state": {"ticket": "Our checkout started returning errors and orders are blocked since 09:40 UTC.",
              "customer": {"plan": "enterprise", "region": "eu-west"}, "attempts": [1, 2, 3]},
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is this urgent?"},
        "team": {"type": "choice", "instructions": "Which team should handle it?",
                 "criteria": {"billing": "payments and invoices", "technical": "outages and bugs",
                              "sales": "new plans"}},
        "severity": {"type": "score", "instructions": "How severe is it?",
                     "criteria": ["minor", "moderate", "major", "critical"]},
    },
}


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--layer-tol", type=float, default=None,
                        help="max |gpu-cpu| / max |cpu| per layer (default: the precision mode's, 2e-3 exact, 3e-2 fast)")
    parser.add_argument("--prob-tol", type=float, default=None,
                        help="max probability difference (default: the precision mode's contract, 2e-3 exact, "
                             "1e-2 fast)")
    parser.add_argument("--precision", choices=precision.CHOICES, default=precision.DEFAULT,
                        help="the GPU precision to check (the one the deployment serves with)")
    parser.add_argument("--gemm", choices=("auto", "wmma", "cublas"), default="auto",
                        help="GEMM kernels to check: auto (as served), or only clefcore's wmma kernels (the path a "
                             "V100 takes where cuBLAS is slower) or only cuBLAS")


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


class _DiskLayer(Mapping):
    """One layer's tensors, read from the checkpoint and widened to fp32 at each access and dropped after
    use, so the fp32 reference never holds the whole model (36 GB for clef-flash) in host memory."""

    def __init__(self, ck, index: int):
        from .model import stored_groups
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
    from .model import Params
    p = Params(ck.text, ck.head_config, _DiskTable(ck.text_tensors["embed_tokens.weight"]), ck.text_f32("norm.weight"),
               _DiskTable(ck.text_tensors["lm_head.weight"]), [_DiskLayer(ck, i) for i in range(ck.text.num_layers)])
    p.head = {n: ck.head_f32(n) for n in ck.head_tensors}
    return p


def compare(ck, ops, params, layer_tol: float = 2e-3, prob_tol: float = 2e-3, out=print) -> bool:
    """Run REQUEST through ``ops``/``params`` and through the streamed fp32 numpy reference of checkpoint ``ck``;
    print the side-by-side report; True when every layer and probability is within tolerance and the answers
    agree."""
    from . import model
    from .backends import cpu
    from .encode import Encoder
    from .tokenize import Tokenizer
    from .validate import validate_request
    rec = Encoder(Tokenizer(ck.tokenizer_path)).encode(validate_request(REQUEST, "cloudflare"), 16384)
    ids, questions = np.asarray(rec.input_ids, np.int64), rec.questions
    L = len(ids)
    cu, pos = np.array([0, L]), np.arange(L)
    p_cpu = streamed_reference_params(ck)
    h_c, kept_c = model.backbone(cpu, p_cpu, ids, cu, pos, keep_layers=True)
    h_g, kept_g = model.backbone(ops, params, ids, cu, pos, keep_layers=True)
    ok = True
    out(f"{L} tokens; per-layer residual stream, device vs fp32 numpy:")
    out(f"{'layer':>5} {'kind':18} {'max abs':>10} {'max rel':>10}")
    for i, (a, b) in enumerate(zip(kept_g, kept_c)):
        a = ops.to_host(a)
        d = float(np.max(np.abs(a - b)))
        r_ = d / max(float(np.max(np.abs(b))), 1e-30)
        flag = "" if r_ <= layer_tol else "  <-- beyond tolerance"
        ok &= r_ <= layer_tol
        out(f"{i:5d} {ck.text.layer_types[i]:18} {d:10.3e} {r_:10.3e}{flag}")
    z_c = model.heads(cpu, p_cpu, h_c, ids, cu, [questions])[0]
    z_g = model.heads(ops, params, h_g, ids, cu, [questions])[0]
    out("head logits (device | cpu) and probabilities:")
    for qi, (zg, zc) in enumerate(zip(z_g, z_c)):
        pg, pc = _softmax(zg), _softmax(zc)
        dp = float(np.max(np.abs(pg - pc)))
        same = int(np.argmax(pg)) == int(np.argmax(pc))
        ok &= dp <= prob_tol and same
        flag = "" if dp <= prob_tol and same else "  <-- beyond tolerance"
        out(f"  question {qi}: answer device {int(np.argmax(pg))} cpu {int(np.argmax(pc))}, max |dp| {dp:.2e}{flag}")
        for a, b, x, y in zip(zg, zc, pg, pc):
            out(f"      {a:10.5f} | {b:10.5f}    p {x:.5f} | {y:.5f}")
    out("verify: " + ("PASS" if ok else "FAIL"))
    return bool(ok)


def run(args) -> int:
    from . import model
    from .backends.cuda import CudaOps
    from .checkpoint import Checkpoint
    ck = Checkpoint(args.model)
    dev = int(args.device.split(":")[1]) if ":" in args.device else 0
    gpu = CudaOps(dev, precision=args.precision, gemm=args.gemm)
    p_gpu = model.load_params(ck, gpu, progress=terminal_bar(f"loading onto {gpu.device_name}"))
    if gpu.fp16_summary():
        print("WARNING:", gpu.fp16_summary())
    layer_bound, prob_bound = precision.VERIFY_BOUND[gpu.mode]
    layer_tol = layer_bound if args.layer_tol is None else args.layer_tol
    prob_tol = prob_bound if args.prob_tol is None else args.prob_tol
    print(f"device: {gpu.device_name}, precision {gpu.mode} ({gpu.precision}), gemm {gpu.gemm_mode}"
          + ("" if gpu.cublas_missing is None else " (cuBLAS not loadable: clefcore's own kernels only)")
          + f", bounds: layer {layer_tol:g}, probability {prob_tol:g}")
    return 0 if compare(ck, gpu, p_gpu, layer_tol, prob_tol) else 1


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="clefcore verify")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
