"""What an image costs the device, in the unit admission, the step sizes and the stall limit count work in.

The vision tower's time for one image grows with its patches (the projections, the MLP) and with their square
(attention inside the tower compares every patch of an image with every other one): at 4 MP the square
dominates, and an image request cost twelve times the device time of a text request with as many tokens. So an
image is counted as the prompt tokens of the same device time: ``per_patch`` times its patches plus
``per_patch_squared`` times their square, both measured when the service starts, on the device at hand (the
tower timed on synthetic images of TOWER_SIDES, against the text rate measured just before). A request costs its
prompt tokens (image placeholders included: they run through the backbone like text) plus its images' towers.

The server's limits on image tokens default to what that cost allows: one image's tower within one auto-sized
step (--step-budget at the measured rate), so that the vision tower, run a block of images per step for a
chunked prompt, keeps every step bounded in time like text steps; a request's images within MAX_IMAGES such
steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from clefcore.images import MAX_ASPECT, MAX_IMAGES
from clefcore.preparer import ImageLimits
from clefcore.preprocess import FACTOR, MERGE, PixelBounds

# The square images the tower is timed on at start (576 and 2,304 patches): two sizes fix both terms, and they
# are small enough for the CPU to time them in well under a second.
TOWER_SIDES = (384, 768)


@dataclass(frozen=True)
class TowerCost:
    """The vision tower's device time for an image, in prompt tokens of the same time (module doc)."""
    per_patch: float
    per_patch_squared: float

    def __post_init__(self):
        if not (self.per_patch >= 0 and self.per_patch_squared >= 0):
            raise ValueError(f"tower cost terms must be >= 0, got {self.per_patch}, {self.per_patch_squared}")

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]], rate: float) -> "TowerCost":
        """The terms through the tower's device seconds on two image sizes (``samples``: (patches, seconds) each),
        counted at ``rate`` prompt tokens per second. Where timing noise makes a term negative, ``ceiling``'s
        instead, which errs towards cost. No samples (the model answers no images): nothing."""
        if not samples:
            return cls(0.0, 0.0)
        (p1, t1), (p2, t2) = _two_points(samples, rate)
        squared = (t2 / p2 - t1 / p1) / (p2 - p1)
        linear = t1 / p1 - squared * p1
        if squared < 0 or linear < 0:
            return cls.ceiling(samples, rate)
        return cls(linear * rate, squared * rate)

    @classmethod
    def ceiling(cls, samples: Sequence[tuple[int, float]], rate: float) -> "TowerCost":
        """A cost that no timing noise brings under the tower's (noise only adds time): each term alone accounts
        for a point's whole time, the small image's for the patches, the large one's for their square. It is
        never below ``fit``'s and grows faster beyond the measured sizes, where ``fit`` extrapolates: on a CPU the
        tower of an image several times the large one's patches took well over what ``fit`` said (memory, not
        arithmetic, grows past the caches there), and more after a noisy small point. Its use is the stall limit,
        which must never take a long tower for a hung device. No samples: nothing."""
        if not samples:
            return cls(0.0, 0.0)
        (p1, t1), (p2, t2) = _two_points(samples, rate)
        return cls(t1 / p1 * rate, t2 / p2 ** 2 * rate)

    def image(self, patches: int) -> int:
        """Prompt tokens of device time that the tower takes for one image of ``patches`` patches."""
        return math.ceil(self.per_patch * patches + self.per_patch_squared * patches * patches)

    def images(self, pixels: Sequence) -> int:
        """The towers of ``pixels`` (clefcore.preprocess.Pixels), each image alone."""
        return sum(self.image(t * h * w) for t, h, w in (p.grid_thw for p in pixels))

    def request(self, prepared) -> int:
        """What a prepared request costs: its prompt tokens and its images' towers."""
        return prepared.num_tokens + self.images(prepared.images)

    def largest_image(self, tokens: float) -> int:
        """The patches of the largest image whose tower costs at most ``tokens`` (a measured tower costs
        something: ValueError for one that costs nothing)."""
        a, b = self.per_patch, self.per_patch_squared
        if b > 0:
            return int((-a + math.sqrt(a * a + 4 * b * tokens)) / (2 * b))
        if a > 0:
            return int(tokens / a)
        raise ValueError("a tower that costs nothing has no largest image")


def _two_points(samples: Sequence[tuple[int, float]], rate: float) -> list[tuple[int, float]]:
    """``samples`` as two (patches, seconds) points, the smaller image first (ValueError for anything else)."""
    points = sorted(samples)
    if not (len(points) == 2 and 0 < points[0][0] < points[1][0] and min(t for _, t in points) >= 0 and rate > 0):
        raise ValueError(f"a tower cost needs two image sizes, their times and a rate, got {samples}, {rate}")
    return points


def least_image(bounds: PixelBounds) -> int:
    """The most tokens an image smaller than ``bounds.min_pixels`` becomes: enlarged to that many pixels, each side
    rounded up to a multiple of 32 (adding less than 32 to it), which adds the most at the widest aspect ratio
    allowed. So small images are answered however slow the tower is (179 tokens at the release's bounds)."""
    low, wide = bounds.min_pixels, MAX_ASPECT
    return math.ceil((math.sqrt(low / wide) + FACTOR) * (math.sqrt(low * wide) + FACTOR) / (FACTOR * FACTOR))


def image_limits(per_image: int | None, per_request: int | None, cost: TowerCost, step_tokens: int,
                 bounds: PixelBounds) -> ImageLimits:
    """The image-token limits: ``per_image`` and ``per_request`` as configured, or where None (auto), those of the
    module doc: one image's tower within ``step_tokens`` (an auto-sized step's tokens), never below what any image
    enlarged to the processor's least pixel count becomes (``least_image``), and MAX_IMAGES of those per
    request."""
    if per_image is None:
        per_image = max(least_image(bounds), cost.largest_image(step_tokens) // (MERGE * MERGE))
    if per_request is None:
        per_request = MAX_IMAGES * per_image
    return ImageLimits(per_image, per_request)
