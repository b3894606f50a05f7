"""The example System One request, defined once: a support ticket asking one question of each type.

It is what ``clefcore demo`` answers, the engine's self-check and ``clefcore verify`` run, and the body the
playground page starts from (the server serves it at GET /example and the page fetches it). The OpenAPI schema's
example is it with another state and an image, the load test sends it with states of chosen sizes, and the server
tests send it.
"""

from __future__ import annotations

import copy

_STATE = "Checkout has been failing for every customer for the last hour."

_SUPPORT_TICKET = {
    "model": "clef-flash",
    "state": _STATE,
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is this support request urgent?"},
        "team": {"type": "choice", "instructions": "Which team should handle this request?",
                 "criteria": {"billing": "Payments, invoices, and refunds",
                              "technical": "Outages, errors, and configuration",
                              "sales": "Plans and upgrades"}},
        "severity": {"type": "score", "instructions": "How severe is the customer impact?",
                     "criteria": ["No impact", "Minor", "Major", "Critical"]},
    },
}


def support_ticket(*, model: str = "clef-flash", state: str = _STATE) -> dict:
    """The example request with this model and state, as a new dict: its nested parts are new too, so the
    caller may change any of them without changing the next caller's copy."""
    return dict(copy.deepcopy(_SUPPORT_TICKET), model=model, state=state)
