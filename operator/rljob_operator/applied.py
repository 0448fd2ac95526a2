"""What the operator applied to a child: a hash of it stamped on the child, so a pass whose child
already is what it would apply sends no PATCH; and the uids that say whose a child is."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# On each applied child: a hash of what the operator applied. A child whose live annotation
# matches what this pass would apply is left alone: a steady state sends no PATCH per child.
APPLIED_HASH = "treetrain.dev/applied-hash"


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with :data:`APPLIED_HASH` set to the hash of its own content (the annotation left out)."""
    meta = dict(obj["metadata"])
    notes = {k: v for k, v in (meta.get("annotations") or {}).items() if k != APPLIED_HASH}
    meta["annotations"] = notes
    body = {**obj, "metadata": meta}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]
    return {**obj, "metadata": {**meta, "annotations": {**notes, APPLIED_HASH: digest}}}


def unchanged(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Whether the live child already is what applying ``desired`` (a :func:`stamped` object) would
    make it. A hand edit that keeps the annotation is not seen here: it is reverted when the RLJob
    (so the hash) next changes, or by deleting the child, which the operator then recreates."""
    if live is None or (live.get("metadata") or {}).get("deletionTimestamp"):
        return False
    want = desired["metadata"]["annotations"][APPLIED_HASH]
    have = ((live.get("metadata") or {}).get("annotations") or {}).get(APPLIED_HASH)
    return bool(have == want and owner_uid(live) == owner_uid(desired))


def object_uid(obj: dict[str, Any] | None) -> str | None:
    uid = ((obj or {}).get("metadata") or {}).get("uid")
    return str(uid) if uid else None


def owner_uid(obj: dict[str, Any]) -> str | None:
    """The uid of the controlling owner (the RLJob, for our children)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("controller")), None)
