"""What the operator remembers across passes, on the ConfigMap ``NAME-config`` (an owned child
only the operator writes): the restart count and time, once the RLJob finished its phase, time
and message, and whether the operator created the key Secret ``NAME-api-key`` (which it cannot
read: operator/rljob_operator/key_secret.py). See operator/rljob_operator/reconcile.py for why the status is never read back
as state."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from rljob_operator.conditions import parse_time
from rljob_operator.models import GROUP

# On the ConfigMap NAME-config: what the operator remembers across passes (see the module doc).
ANNOTATION_STATE = f"{GROUP}/state"
MAX_MEMORY_MESSAGE = 512
# Whether the operator created the key Secret NAME-api-key: none, pending (a create was sent,
# its outcome not recorded) or created (operator/rljob_operator/key_secret.py).
KeyState = Literal["none", "pending", "created"]


@dataclass(frozen=True)
class Memory:
    """What the operator recorded on its ConfigMap (:data:`ANNOTATION_STATE`)."""

    restarts: int = 0
    last_restart: str | None = None  # when the last restart was decided: the backoff's clock
    finished: str | None = None  # "Succeeded" or "Failed" once the RLJob finished
    finished_at: str | None = None  # the TTL's clock
    message: str = ""
    key: KeyState = "none"  # the key Secret NAME-api-key (see KeyState)

    def annotation(self) -> str:
        body = {"restarts": self.restarts, "lastRestart": self.last_restart, "finished": self.finished,
                "finishedAt": self.finished_at, "message": self.message[:MAX_MEMORY_MESSAGE] or None,
                "key": self.key}  # fmt: skip
        return json.dumps({k: v for k, v in body.items() if v is not None}, sort_keys=True, separators=(",", ":"))


def read_memory(configmap: dict[str, Any] | None) -> Memory:
    """The record on ``configmap``; one that is missing or unreadable counts as empty."""
    written = annotations_of(configmap).get(ANNOTATION_STATE)
    if not written:
        return Memory()
    try:
        note = json.loads(written)
        restarts = int(note.get("restarts", 0))
        finished = note.get("finished")
        last, done = note.get("lastRestart"), note.get("finishedAt")
        parse_time(last), parse_time(done)  # a time that does not parse makes the whole record void
        # Absent: written before the entry existed, by an operator that created the Secret.
        key = note.get("key", "created")
    except (ValueError, TypeError, AttributeError):
        return Memory()
    return Memory(
        restarts=max(restarts, 0),
        last_restart=last,
        finished=finished if finished in ("Succeeded", "Failed") else None,
        finished_at=done,
        message=str(note.get("message") or ""),
        key=key if key in get_args(KeyState) else "none",
    )


def with_memory(objects: list[dict[str, Any]], memory: Memory) -> list[dict[str, Any]]:
    """``objects`` with the record on the trainer ConfigMap (every apply carries it, or server-side
    apply would drop it)."""
    out = []
    for obj in objects:
        if _is_record(obj):
            meta = obj["metadata"]
            obj = {**obj, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}),
                                                               ANNOTATION_STATE: memory.annotation()}}}  # fmt: skip
        out.append(obj)
    return out


def with_key(objects: list[dict[str, Any]], state: KeyState) -> list[dict[str, Any]]:
    """``objects`` with the record on the trainer ConfigMap saying ``state`` of the key Secret."""
    return [with_memory([o], replace(read_memory(o), key=state))[0] if _is_record(o) else o for o in objects]


def record_of(objects: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The trainer ConfigMap among ``objects``, which carries the record."""
    return next((o for o in objects if _is_record(o)), None)


def _is_record(obj: dict[str, Any]) -> bool:
    return bool(obj["kind"] == "ConfigMap" and obj["metadata"]["name"].endswith("-config"))


def annotations_of(obj: dict[str, Any] | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("annotations") or {})
