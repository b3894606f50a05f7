"""Images on the GPU engine against tests/golden_images, in every precision mode of tests/test_gpu_engine.py
(fast and exact, natively and through the compute_70 PTX; split8 where fp8 exists), with its bounds: each
fixture's probabilities within the mode's contract (exact 2e-4, fast 1e-2); the vision tower stage by stage
against the numpy tower (the hidden-state bounds); image and text-only requests packed into one forward answer
as each alone; chunked prefill with images answers as the whole prompt. Skips cleanly without a GPU."""

import json
from pathlib import Path

import numpy as np
import pytest

from gpu_only import MARKS

pytestmark = MARKS
cupy = pytest.importorskip("cupy")

import clefcore  # noqa: E402
from clefcore.backends.cpu import CpuOps  # noqa: E402
from clefcore.model import vision  # noqa: E402
from golden_images_data import EXPECTED, MODEL  # noqa: E402
from test_gpu_engine import BOUND, STATES_BOUND, modes, softmax, cuda_options  # noqa: E402
from test_images_golden import OK, prepared  # noqa: E402

TEXT = json.loads((Path(__file__).parent / "golden" / "requests.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module", params=modes())
def engine(request):
    return clefcore.load(MODEL, device="cuda:0", confidence="reference", validation="reference",
                         **cuda_options(request.param))


@pytest.fixture(scope="module")
def reference():
    return clefcore.load(MODEL, device="cpu", confidence="reference", validation="reference")


def _label(engine) -> str:
    ops = engine.ops
    return f"{'ptx70' if ops.ctx.ptx70 else 'native'}, {ops.mode} = {ops.plan.path}, gemm {ops.gemm.pin}"


def _prob_error(logits, questions) -> float:
    """Worst probability error of one request's logits against the fixture's probabilities."""
    return max(float(np.max(np.abs(softmax(z) - np.array(q["probabilities"])))) for z, q in zip(logits, questions))


def _prob_diff(a, b) -> float:
    return max(float(np.max(np.abs(softmax(x) - softmax(y)))) for x, y in zip(a, b))


def test_golden_images_probabilities(engine):
    assert engine.vision is not None, engine.images_refused
    worst = 0.0
    for fx in OK:
        (logits,), _, _ = engine.forward([prepared(engine, fx["index"]).record])
        err = _prob_error(logits, fx["questions"])
        worst = max(worst, err)
        assert err <= BOUND[engine.ops.mode], f"{fx['name']}: probability error {err:.2e} ({_label(engine)})"
    print(f"GOLDEN IMAGES worst probability error ({_label(engine)}): {worst:.3e}, fallbacks {engine.fallbacks}")


def test_tower_stages_against_numpy(engine, reference):
    """Every fixture's images in one tower call (each attends only to itself): patch and position embeddings,
    every block's output and the merger's, relative to the numpy tower's largest value."""
    images = [px for fx in OK for px in prepared(reference, fx["index"]).record.images]
    pixels, grids = np.concatenate([px.values for px in images]), [px.grid_thw for px in images]
    got, want = {}, {}
    out = vision.tower(engine.ops, engine.vision, pixels, grids, got)
    ref = vision.tower(CpuOps(), reference.vision, pixels, grids, want)
    host = engine.ops.to_host
    stages = [("patch embeddings", got["patch_embeds"], want["patch_embeds"]),
              ("position embeddings", got["pos_embeds"], want["pos_embeds"])]
    stages += [(f"block {j}", a, b) for j, (a, b) in enumerate(zip(got["blocks"], want["blocks"], strict=True))]
    stages.append(("merger", out, ref))
    errors = {}
    for name, a, b in stages:
        errors[name] = float(np.max(np.abs(host(a) - b)) / np.max(np.abs(b)))
    print(f"TOWER {len(images)} images, {len(pixels)} patches ({_label(engine)}): "
          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if v > STATES_BOUND[engine.ops.mode]}
    assert not bad, bad


def test_packed_image_and_text_requests_answer_as_alone(engine):
    """Four images, a text-only request and one image in one forward (M-RoPE rows for all three): each answer
    equals its own forward's (GEMMs over other row counts may take other paths: within half the mode's bound)
    and the image requests stay within the bound of the fixture."""
    records = [prepared(engine, 3).record, engine.prepare(TEXT).record, prepared(engine, 0).record]
    packed, _, _ = engine.forward(records)
    for rec, z in zip(records, packed):
        (alone,), _, _ = engine.forward([rec])
        d = _prob_diff(z, alone)
        print(f"PACKED ({_label(engine)}) {len(rec.images)} images, {len(rec.input_ids)} tokens: {d:.2e}")
        assert d <= BOUND[engine.ops.mode] / 2
    for z, fx in ((packed[0], EXPECTED[3]), (packed[2], EXPECTED[0])):
        assert _prob_error(z, fx["questions"]) <= BOUND[engine.ops.mode], fx["name"]


@pytest.mark.parametrize("chunk", [37, 100])
def test_chunked_prefill_with_images_equals_whole(engine, chunk):
    """Chunk borders fall inside the image pad runs (37) and between images (100)."""
    p = prepared(engine, 3)
    (whole,), _, _ = engine.forward([p.record])
    run = engine.chunked(p, chunk)
    while not run.step():
        pass
    d = _prob_diff(run.logits(), whole)
    print(f"CHUNKED ({_label(engine)}) chunk {chunk}: {d:.2e}")
    assert d <= BOUND[engine.ops.mode] / 2
    assert _prob_error(run.logits(), EXPECTED[3]["questions"]) <= BOUND[engine.ops.mode]


def test_tower_graph_replays_as_eager_with_fresh_inputs(engine):
    """The fast mode's tower replays a CUDA graph from its second call for one set of image sizes: two different
    images of one size, each answered as by the eager tower (``keep`` keeps it eager), and a replay's result is
    the caller's (the next replay does not rewrite it). The exact modes stay eager."""
    from clefcore.preprocess import pixels
    ops, vp = engine.ops, engine.vision
    rng = np.random.default_rng(1)
    imgs = [pixels(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)) for _ in range(2)]

    def tower(px, keep=None):
        return vision.tower(ops, vp, ops.patch_rows([px.image]), [px.grid_thw], keep)

    eager = [ops.to_host(tower(px, {})) for px in imgs]
    assert np.max(np.abs(eager[0] - eager[1])) > 1e-2 * np.max(np.abs(eager[0]))     # the inputs matter
    l0 = ops.tower_graphs.launches
    outs = [tower(px) for px in imgs + imgs]            # eager (first sight), capture + replay, replay, replay
    for i, out in enumerate(outs):
        want = eager[i % 2]
        err = float(np.max(np.abs(ops.to_host(out) - want)) / np.max(np.abs(want)))
        assert err <= 1e-5, f"call {i}: {err:.2e} ({_label(engine)})"
    assert ops.tower_graphs.launches - l0 == (3 if ops.plan.row.tower_graphs else 0), _label(engine)


@pytest.fixture(scope="module")
def release_tower():
    """The release's tower shapes (27 blocks, hidden 1152, head dim 72) with random weights, and a 64x48 PNG's
    pixels (280 patches: several 64-row tiles), for the shapes the golden models (head dim 16) do not have."""
    from clefcore import images
    from clefcore.preprocess import preprocess
    from clefcore.synth import config_json, picture_png
    cfg = vision.VisionConfig.from_dict(config_json("clef-flash", vision=True)["vision_config"])
    return cfg, preprocess(images.decode(picture_png(64, 48), 0))


def test_release_shaped_tower_against_numpy(engine, release_tower):
    """bench's random_vision_params on this engine's ops, copied to the host exactly (fp16 matrices widen
    exactly), through both towers: every block and the merger within the mode's hidden-state bound (a numpy
    emulation of the kernels' fp16 roundings gave 1.3e-4 exact, 6.4e-4 fast)."""
    from clefcore.bench.weights import random_vision_params
    cfg, px = release_tower
    ops = engine.ops
    gpu = random_vision_params(cupy, ops, cfg)
    host = vision.VisionParams(cfg, {k: ops.to_host(w).astype(np.float32) for k, w in gpu.w.items()})
    got, want = {}, {}
    out = ops.to_host(vision.tower(ops, gpu, px.values, [px.grid_thw], got))
    ref = vision.tower(CpuOps(), host, px.values, [px.grid_thw], want)
    errors = [float(np.max(np.abs(ops.to_host(a) - b)) / np.max(np.abs(b)))
              for a, b in zip(got["blocks"] + [out], want["blocks"] + [ref])]
    print(f"RELEASE TOWER ({_label(engine)}): worst block {max(errors[:-1]):.2e}, merger {errors[-1]:.2e}")
    assert max(errors) <= STATES_BOUND[ops.mode]
