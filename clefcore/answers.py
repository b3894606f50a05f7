"""From head logits to the System One response (systemone-protocol.md §5-6, clef-head.md §6).

Probabilities are an fp32 softmax per question (as the reference computes them), turned into Python floats
before ``round(x, 4)``. The argmax and the score use the unrounded values. Choice probabilities are listed
in the request's criteria order; the model's option order is sorted (``EncodedQuestion.option_ids``).
"""

from __future__ import annotations

import numpy as np

from .encode import EncodedRecord
from .errors import DeviceError

CONFIDENCE_MODES = ("cloudflare", "reference", "typesafe")


def softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float32)
    e = np.exp(z - z.max())
    return e / e.sum()


def confidence(p: list[float], kind: str, mode: str) -> float:
    """``p`` is the distribution in level/option order. cloudflare: (K*sum p^2 - 1)/(K - 1);
    reference: the top probability; typesafe: (K*p_max - 1)/(K - 1) for choice, 1 - MAD/MAD_uniform for score."""
    k = len(p)
    top = max(p)
    if mode == "reference":
        return top
    if k == 1:
        return 1.0
    if mode == "cloudflare":
        return (k * sum(x * x for x in p) - 1.0) / (k - 1)
    if mode == "typesafe":
        if kind == "choice":
            return (k * top - 1.0) / (k - 1)
        mode_i = p.index(top)
        mad = sum(x * abs(i - mode_i) for i, x in enumerate(p))
        mad_uniform = sum(abs(i - (k - 1) / 2) for i in range(k)) / k
        return max(0.0, 1.0 - mad / mad_uniform)
    raise ValueError(f"confidence mode {mode!r} is not one of {CONFIDENCE_MODES}")


def answer(question: dict, model_ids: tuple[str, ...], probs: np.ndarray, mode: str) -> dict:
    p = {oid: float(x) for oid, x in zip(model_ids, probs)}
    kind = question["type"]
    if kind == "noul":
        return {"type": "noul", "noul": round(p["true"], 4)}
    if kind == "choice":
        order = list(question["criteria"])                    # request order
        dist = [p[o] for o in order]
        best = order[dist.index(max(dist))]                   # first maximum in request order
        conf = round(confidence(dist, kind, mode), 4)
        probabilities = {o: round(p[o], 4) for o in order}
        if mode == "cloudflare":
            return {"type": "choice", "choice": best, "probabilities": probabilities, "confidence": conf}
        return {"type": "choice", "choice": best, "confidence": conf, "probabilities": probabilities}
    levels = question["criteria"]
    dist = [p[str(i)] for i in range(len(levels))]
    score = 0.0
    for i, x in enumerate(dist):                              # double sum, left to right
        score += i * x
    conf = round(confidence(dist, kind, mode), 4)
    legend = {str(i): level for i, level in enumerate(levels)}
    probabilities = {str(i): round(x, 4) for i, x in enumerate(dist)}
    if mode == "cloudflare":
        return {"type": "score", "score": round(score, 4), "legend": legend, "probabilities": probabilities,
                "confidence": conf}
    return {"type": "score", "score": round(score, 4), "confidence": conf, "legend": legend,
            "probabilities": probabilities}


def response(request: dict, record: EncodedRecord, logits: list[np.ndarray], mode: str) -> dict:
    """The bare System One body. Key order inside answers follows the host being imitated: Cloudflare's
    order for ``cloudflare`` confidence, the reference's otherwise."""
    answers = {}
    for q, z in zip(record.questions, logits):
        if z.shape != (len(q.option_ids),) or not np.all(np.isfinite(z)):
            raise DeviceError(f"question {q.id!r}: head produced {z.shape[0]} logits for {len(q.option_ids)} "
                              f"options, finite: {bool(np.all(np.isfinite(z)))}")
        answers[q.id] = answer(request["questions"][q.id], q.option_ids, softmax(z), mode)
    return {"model": request["model"], "answers": answers,
            "usage": {"input_tokens": int(len(record.input_ids)), "output_tokens": 0}}
