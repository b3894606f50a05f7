"""Logits -> System One answers: softmax, rounding, argmax order, score, legend, confidence modes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clefcore import answers
from clefcore.encode import EncodedQuestion, EncodedRecord


def record(questions):
    return EncodedRecord(np.zeros(7, np.int32), tuple(questions), (0, 1), 1, False)


def q(qid, kind, option_ids):
    return EncodedQuestion(qid, kind, {"noul": 0, "choice": 1, "score": 2}[kind], (0, 1), tuple(option_ids),
                           tuple((0, 1) for _ in option_ids))


def test_choice_lists_request_order_and_takes_first_maximum():
    request = {"model": "m", "state": "", "questions": {"c": {"type": "choice", "criteria": {"z": 1, "a": 2, "m": 3}}}}
    rec = record([q("c", "choice", ["a", "m", "z"])])                  # model order is sorted
    z = np.log(np.array([0.4, 0.2, 0.4], np.float32))                    # a and z tie
    out = answers.response(request, rec, [z], "reference")
    a = out["answers"]["c"]
    assert list(a["probabilities"]) == ["z", "a", "m"]
    assert a["choice"] == "z"                                            # first maximum in request order
    assert list(a) == ["type", "choice", "confidence", "probabilities"]
    assert out["usage"] == {"input_tokens": 7, "output_tokens": 0}
    cf = answers.response(request, rec, [z], "cloudflare")["answers"]["c"]
    assert list(cf) == ["type", "choice", "probabilities", "confidence"]


def test_score_is_expectation_of_unrounded_probabilities():
    levels = ["low", {"x": 1}, ["y"]]
    request = {"model": "m", "state": "", "questions": {"s": {"type": "score", "criteria": levels}}}
    z = np.array([0.3, -1.0, 2.0], np.float32)
    a = answers.response(request, record([q("s", "score", ["0", "1", "2"])]), [z], "reference")["answers"]["s"]
    p = answers.softmax(z).astype(np.float64)
    assert a["score"] == round(float(p[1] + 2 * p[2]), 4)
    assert a["legend"] == {"0": "low", "1": {"x": 1}, "2": ["y"]}
    assert a["confidence"] == round(float(p.max()), 4)


def test_noul_has_exactly_type_and_noul():
    request = {"model": "m", "state": "", "questions": {"n": {"type": "noul"}}}
    a = answers.response(request, record([q("n", "noul", ["true", "false"])]),
                         [np.array([1.0, 0.0], np.float32)], "cloudflare")["answers"]["n"]
    assert a == {"type": "noul", "noul": round(1 / (1 + math.exp(-1.0)), 4)}


@pytest.mark.parametrize("probs,cloudflare,typesafe", [
    ([0.0505, 0.9355, 0.014], 0.8169, 0.9032),          # recorded Workers AI clef-flash `team` (protocol §6.4)
    ([0.1762, 0.8088, 0.015], 0.5281, 0.7132),
])
def test_confidence_formulas_match_recorded_values(probs, cloudflare, typesafe):
    assert round(answers.confidence(probs, "choice", "cloudflare"), 4) == pytest.approx(cloudflare, abs=1e-4)
    assert round(answers.confidence(probs, "choice", "typesafe"), 4) == pytest.approx(typesafe, abs=1e-4)
    assert answers.confidence(probs, "choice", "reference") == max(probs)


def test_typesafe_score_confidence():
    # TypeSafe hosted `stars`: 0/0/0.01/0.83/0.16 reported 0.86 (0.8583 recomputed from rounded values)
    assert round(answers.confidence([0, 0, 0.01, 0.83, 0.16], "score", "typesafe"), 4) == 0.8583


def test_non_finite_logits_are_refused():
    request = {"model": "m", "state": "", "questions": {"n": {"type": "noul"}}}
    with pytest.raises(answers.DeviceError):
        answers.response(request, record([q("n", "noul", ["true", "false"])]),
                         [np.array([np.nan, 0.0], np.float32)], "cloudflare")
