"""The RLJob status conditions and the times in its status: set one condition (its transition
time moves only when its status does), read one, the operator's time format, and the backoff."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

BACKOFF_MAX_SECONDS = 300.0


def timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def backoff_seconds(attempts: int, base: float, cap: float = BACKOFF_MAX_SECONDS) -> float:
    """Delay before try ``attempts`` (1-based): base, 2*base, 4*base, ... capped (5 min by default)."""
    return float(min(base * 2.0 ** max(attempts - 1, 0), cap))


def set_condition(
    conditions: list[dict[str, Any]],
    kind: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int | None,
) -> None:
    """Set one condition in place; its transition time moves only when its status does."""
    value = "Unknown" if status is None else ("True" if status else "False")
    for cond in conditions:
        if cond["type"] == kind:
            if cond["status"] != value:
                cond["lastTransitionTime"] = timestamp(now)
            cond.update(status=value, reason=reason, message=message, observedGeneration=generation)
            return
    conditions.append(
        {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": timestamp(now),
            "observedGeneration": generation,
        }
    )


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


class Conditions:
    def __init__(self, status: dict[str, Any], now: datetime, generation: int | None) -> None:
        self.status, self.now, self.generation = status, now, generation

    def set(self, kind: str, value: bool | None, reason: str, message: str) -> None:
        set_condition(self.status["conditions"], kind, value, reason, message, now=self.now, generation=self.generation)


def set_or_drop(status: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        status.pop(key, None)
    else:
        status[key] = value


def whole_seconds(text: Any) -> str | None:
    """``text`` as an RFC 3339 time in whole seconds (UTC), or None when it is not one."""
    if not isinstance(text, str):
        return None
    whole: str = text.split(".")[0].rstrip("Z") + "Z"
    try:
        parse_time(whole)
    except ValueError:
        return None
    return whole
