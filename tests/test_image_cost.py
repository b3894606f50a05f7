"""What images cost (server/image_cost.py) and how the batcher counts it: the tower's cost fitted in patches and
patches squared, the image-token limits sized from it, and a chunked image request run a block of images per step
whose stall limit is its own tower's expected time, on a real event loop with a device that takes exactly the
time its work costs."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from clefcore.preprocess import PixelBounds, smart_resize
from clefcore.server.admission import Budgets
from clefcore.server.batcher import Batcher
from clefcore.server.device_process import Step
from clefcore.server.device_watch import DeviceWatch
from clefcore.server.image_cost import TowerCost, image_limits, least_image
from clefcore.server.metrics import Metrics
from server_harness import FAKE_STATUS, Prepared


def test_fit_through_two_sizes():
    # 2e-6 s a patch and 1e-9 s a patch squared, at 10,000 tokens/s: 0.02 and 1e-5 tokens
    seconds = [(p, 2e-6 * p + 1e-9 * p * p) for p in (576, 2304)]
    cost = TowerCost.fit(seconds, 10_000.0)
    assert cost.per_patch == pytest.approx(0.02) and cost.per_patch_squared == pytest.approx(1e-5)
    assert cost.image(62_500) == math.ceil(0.02 * 62_500 + 1e-5 * 62_500 ** 2)      # 40,313 tokens
    assert TowerCost.fit([], 10_000.0) == TowerCost(0.0, 0.0)                     # no tower, no cost


def test_a_noisy_fit_errs_towards_cost():
    # the small image took longer per patch than the large one: no square term fits; each term then takes its
    # point's whole time, so both points cost at least what they took
    samples = [(576, 0.010), (2304, 0.020)]
    cost = TowerCost.fit(samples, 1_000.0)
    for patches, seconds in samples:
        assert cost.image(patches) >= seconds * 1_000.0
    # far beyond them the square term still counts: a 62,500-patch image costs more than the line through them
    assert cost.image(62_500) > 1_000.0 * 0.020 * 62_500 / 2304 * 10


def test_the_ceiling_is_never_under_the_fit_nor_a_point():
    for samples in ([(576, 0.013), (2304, 0.123)], [(576, 0.025), (2304, 0.123)], [(576, 0.010), (2304, 0.020)]):
        fit, ceiling = TowerCost.fit(samples, 1_000.0), TowerCost.ceiling(samples, 1_000.0)
        for patches, seconds in samples:
            assert ceiling.image(patches) >= seconds * 1_000.0
        for patches in (1, 576, 1_000, 2_304, 16_384, 62_500):
            assert ceiling.image(patches) >= fit.image(patches)
    # a noisy small point (0.025 s for 0.013) takes the fit's square term down 6x; not the ceiling's
    clean, noisy = [(576, 0.013), (2304, 0.123)], [(576, 0.025), (2304, 0.123)]
    assert TowerCost.fit(noisy, 1_000.0).image(16_384) < 0.6 * TowerCost.fit(clean, 1_000.0).image(16_384)
    assert TowerCost.ceiling(noisy, 1_000.0).image(16_384) >= TowerCost.ceiling(clean, 1_000.0).image(16_384)
    assert TowerCost.ceiling([], 1.0) == TowerCost(0.0, 0.0)
    with pytest.raises(ValueError):
        TowerCost.ceiling([(576, 0.01)], 1.0)


def test_largest_image_inverts_the_cost():
    cost = TowerCost(0.5, 1e-4)
    for tokens in (100.0, 1_024.0, 8_192.0):
        patches = cost.largest_image(tokens)
        assert cost.image(patches) <= math.ceil(tokens) and cost.image(patches + 1) > tokens
    assert TowerCost(0.5, 0.0).largest_image(1_000.0) == 2_000
    with pytest.raises(ValueError):
        TowerCost(0.0, 0.0).largest_image(1_000.0)


def test_image_limits_default_to_one_step_per_image():
    cost = TowerCost(0.5, 1e-4)
    limits = image_limits(None, None, cost, 1_024, PixelBounds())
    assert limits.per_image == cost.largest_image(1_024) // 4 and limits.per_request == 4 * limits.per_image
    assert image_limits(300, None, cost, 1_024, PixelBounds()).per_request == 1_200
    assert image_limits(None, 500, cost, 1_024, PixelBounds()).per_request == 500
    # never below what the least images become: a slow tower still answers small images
    assert least_image(PixelBounds()) == 179
    assert image_limits(None, None, TowerCost(100.0, 1.0), 1_024, PixelBounds()).per_image == 179


def test_every_image_enlarged_to_the_least_pixels_fits_the_least_image():
    # every size whose rounded area is below the release's least pixels: those under 400 pixels high (taller ones
    # round to at least 12 x 12 blocks of 32, over 65,536 pixels), each width up to the aspect ratio's limit or to
    # where even a 32-pixel-high rounding exceeds the bound
    bounds = PixelBounds()
    worst = 0
    for height in range(1, 400):
        for width in range(height, min(200 * height, 4_100) + 1):
            if round(height / 32) * round(width / 32) * 1024 < bounds.min_pixels:    # enlarged
                h, w = smart_resize(height, width, bounds)
                worst = max(worst, h * w // 1024)
    assert worst == 128 <= least_image(bounds)       # 1 x 63 pixels -> 64 x 2048


# --- the batcher: an image request's steps and their stall limits ------------------------------------------------

RATE = 10_000.0     # tokens/s: the fake device takes a step's cost at this rate, and the batcher measures it so


def picture(side_patches: int) -> SimpleNamespace:
    return SimpleNamespace(grid_thw=(1, side_patches, side_patches))


class TimedDevice:
    """A device process that takes exactly what its work costs at RATE: a packed batch its requests' costs, a
    vision tower step its images' towers, a chunk its tokens. Records each step's images argument."""

    def __init__(self, tower: TowerCost):
        self.status = FAKE_STATUS
        self.lost = None
        self.tower = tower
        self.steps: list[int] = []
        self.run = None

    async def infer(self, prepared):
        seconds = sum(self.tower.request(p) for p in prepared) / RATE
        await asyncio.sleep(seconds)
        return [({"prompt": p.name}, None) for p in prepared], seconds

    async def step(self, prepared, tokens, images=0):
        self.steps.append(images)
        if prepared is not None:
            self.run = [prepared, prepared.num_tokens, list(prepared.images)]
        run, towered = self.run, 0
        if images and run[2]:
            block, run[2] = run[2][:images], run[2][images:]
            seconds = self.tower.images(block) / RATE
            done = False
        else:
            towered, run[2] = self.tower.images(run[2]), []
            taken = min(tokens, run[1])
            run[1] -= taken
            seconds = (towered + taken) / RATE
            done = run[1] == 0
        await asyncio.sleep(seconds)
        text = 0 if images else taken
        return Step(done, {"prompt": run[0].name} if done else None, text, run[1], None, seconds, len(run[2]))

    async def self_check(self):
        pass


def serve(tower: TowerCost, device_tower: TowerCost, requests: list[Prepared], stall_s: float,
          ceiling: TowerCost | None = None):
    """Submit ``requests`` one at a time to a batcher that counts images at ``tower`` (their stall limits at
    ``ceiling``) on a device whose images take ``device_tower``: (the outcomes, the steps' images arguments, the
    troubles the watch found)."""
    metrics, troubles = Metrics(), []
    device = TimedDevice(device_tower)

    async def main():
        w = DeviceWatch(metrics, stall_s, 30.0, on_change=troubles.append, on_expired=lambda trouble: None)
        b = Batcher([device], metrics, watch=w, max_queue=8, max_batch_tokens=6_000, max_batch_requests=4,
                    budgets=Budgets(60.0, 60.0, 10_000), start_rate=RATE, chunk_tokens=6_000, tower=tower,
                    tower_ceiling=ceiling)
        b.start()
        outcomes = []
        for r in requests:
            outcomes.append(await b.submit(r, time.monotonic() + 60))
        await b.stop()
        w.close()
        return outcomes

    return asyncio.run(main()), device.steps, troubles


# 64 x 64 patches (a 1024 x 1024 image): 4,096 patches, 1,024 image tokens, and a tower of 0.4 s at RATE
TOWER = TowerCost(0.0, 4_000.0 / 4_096 ** 2)


def test_a_long_image_request_runs_its_towers_a_step_each_and_is_never_taken_for_a_stall():
    # two images of 4,000 tokens of tower each and 1,100 prompt tokens: 9,100 > 6,000, chunked; each tower alone
    # takes 0.4 s, twice the 0.2 s floor of the stall limit, which counting only its tokens would have tripped
    two = Prepared(num_tokens=1_100, name="two", images=(picture(64), picture(64)))
    assert TOWER.request(two) == 9_100
    outcomes, steps, troubles = serve(TOWER, TOWER, [two, Prepared(num_tokens=50, name="after")], stall_s=0.2)
    assert [o.response["prompt"] for o in outcomes] == ["two", "after"]
    assert steps == [1, 1, 0]                 # one image's tower per step, then the text in one chunk
    assert troubles == []
    # the control: the same device and request, with the towers counted as free, trips the stall limit
    outcomes, _, troubles = serve(TowerCost(0.0, 0.0), TOWER, [two], stall_s=0.2)
    assert outcomes[0].response["prompt"] == "two"
    assert [t.kind for t in troubles if t is not None] == ["stalled"]


def test_a_whole_image_request_is_counted_at_its_towers_cost():
    one = Prepared(num_tokens=1_100, name="one", images=(picture(64),))      # 5,100: packed, 0.51 s
    outcomes, steps, troubles = serve(TOWER, TOWER, [one], stall_s=0.2)
    assert outcomes[0].response["prompt"] == "one" and outcomes[0].batch_tokens == 5_100
    assert steps == [] and troubles == []


# Fitted on 8 x 8 and 16 x 16 patch images (1e-5 s a patch, 1e-9 s a patch squared), and the 64 x 64 one's tower
# taking six times what the fit says (0.35 s against 0.058 s, as past the caches on a CPU, or after a noisy point)
SMALL_POINTS = [(p, 1e-5 * p + 1e-9 * p * p) for p in (64, 256)]
SLOWER = TowerCost(0.0, 6 * TowerCost.fit(SMALL_POINTS, RATE).image(4_096) / 4_096 ** 2)


@pytest.mark.parametrize("packed", [False, True])
def test_a_tower_slower_than_its_fit_beyond_the_measured_sizes_is_busy_at_the_ceiling(packed):
    fit, ceiling = TowerCost.fit(SMALL_POINTS, RATE), TowerCost.ceiling(SMALL_POINTS, RATE)
    assert SLOWER.image(4_096) > 4 * (fit.image(4_096) + 100) and SLOWER.image(4_096) / RATE > 0.1   # past it
    assert ceiling.image(4_096) > SLOWER.image(4_096)
    # one image and 100 prompt tokens: one step's work (packed) or more (chunked: its tower a step)
    request = Prepared(num_tokens=100 if packed else 6_000, name="image", images=(picture(64),))
    outcomes, steps, troubles = serve(fit, SLOWER, [request], stall_s=0.1, ceiling=ceiling)
    assert outcomes[0].response["prompt"] == "image" and troubles == []
    assert steps == ([] if packed else [1, 0])
    _, _, troubles = serve(fit, SLOWER, [request], stall_s=0.1)     # the control: the fit's limit trips
    assert [t.kind for t in troubles if t is not None] == ["stalled"]
