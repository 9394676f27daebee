"""``/status`` for callers who may not see internals (pure).

The full document names rank PIDs, node addresses, Ray actor ids and failure texts (exception
messages, Ray's OOM reports). The public view keeps what an operator or a dashboard needs —
readiness, replicas, phases, revisions, acceptance length, collectives against the plan, failure
kinds and times — and drops the rest:

    public_status({"groups": [{"ranks": [{"rank": 0, "pid": 4711, "node": "10.0.0.3"}]}],
                   "last_failure": {"group": 0, "kind": "RankFailed", "reason": "ActorDiedError: ..."}})
    -> {"groups": [{"ranks": [{"rank": 0}]}],
        "last_failure": {"group": 0, "kind": "RankFailed", "reason": "RankFailed (details withheld: ...)"}}

A failure keeps a ``reason`` (readers such as the operator's status mirror expect one), saying only
its kind; a condition's ``reason`` (``Unschedulable``) is ours and stays.
"""

from __future__ import annotations

from typing import Any

PRIVATE_KEYS = frozenset({"pid", "node", "actor_id", "error"})
WITHHELD = "details withheld: /status with the API key, or the controller's log"


def public_status(doc: Any) -> Any:
    """``doc`` without the PRIVATE_KEYS and with failure reasons withheld, at any depth (conditions
    keep their own messages: ours, not exception texts, e.g. "1/2 engine groups ready")."""
    if isinstance(doc, dict):
        out = {k: public_status(v) for k, v in doc.items() if k not in PRIVATE_KEYS}
        if "reason" in out and "kind" in doc:  # a failure (a condition's reason is ours: kept)
            out["reason"] = f"{doc['kind']} ({WITHHELD})"
        return out
    if isinstance(doc, list):
        return [public_status(v) for v in doc]
    return doc
