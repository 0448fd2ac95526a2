"""What a reconcile pass costs in API requests: a steady RLJob costs reads only (no PATCH, no
POST), a changed or missing child is written again, and the watch settings recover quickly.

An in-memory stand-in for the API layer counts the requests by verb (no API server runs here).
"""

from __future__ import annotations

import collections
import copy
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from rljob_operator.applied import APPLIED_HASH, stamped, unchanged
from rljob_operator.controller import CHILD_KINDS, Controller, _normalised
from rljob_operator.handlers import tune_watching
from rljob_operator.kube import Kube
from rljob_operator.metrics import Metrics
from rljob_operator.names import LABEL_RLJOB

ROOT = Path(__file__).resolve().parents[2]
WRITES = ("apply", "create", "patch_status", "delete", "event")


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """JSON merge patch, as the API server applies it (null removes a member)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class _MemoryKube:
    """The Kube methods the controller calls, over a dict of objects; counts requests by verb."""

    def __init__(self, rljob: dict[str, Any]) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {("RLJob", rljob["metadata"]["name"]): rljob}
        self.requests: collections.Counter[str] = collections.Counter()
        self.applied: list[tuple[str, str]] = []

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.requests["get"] += 1
        return copy.deepcopy(self.objects.get((kind, name)))

    def children(self, kind: str, namespace: str, rljob: str) -> list[dict[str, Any]]:
        self.requests["list"] += 1
        return [copy.deepcopy(o) for (k, _), o in self.objects.items()
                if k == kind and o["metadata"].get("labels", {}).get(LABEL_RLJOB) == rljob]  # fmt: skip

    def apply(self, obj: dict[str, Any], live: dict[str, Any] | None = None) -> None:
        self.requests["apply"] += 1
        self.applied.append((obj["kind"], obj["metadata"]["name"]))
        self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)

    def create_key(self, obj: dict[str, Any]) -> bool:
        exists = (obj["kind"], obj["metadata"]["name"]) in self.objects
        self.create_if_missing(obj)
        return not exists

    def create_if_missing(self, obj: dict[str, Any]) -> bool:
        self.requests["create"] += 1
        return self.objects.setdefault((obj["kind"], obj["metadata"]["name"]), copy.deepcopy(obj)) is obj

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        self.requests["delete"] += 1
        self.objects.pop((kind, name), None)

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any], resource_version: str) -> None:
        self.requests["patch_status"] += 1
        _merge(self.objects[("RLJob", name)].setdefault("status", {}), patch)

    def event(self, rljob: dict[str, Any], kind: str, reason: str, message: str) -> None:
        self.requests["event"] += 1

    def writes(self) -> int:
        return sum(self.requests[v] for v in WRITES)


def _setup(*, generation: int | None = 1) -> tuple[Controller, _MemoryKube]:
    rljob = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    rljob["metadata"] = {"name": "demo", "namespace": "ml", "uid": "u1", "resourceVersion": "1"}
    if generation is not None:
        rljob["metadata"]["generation"] = generation
    kube = _MemoryKube(rljob)
    return Controller(kube=kube, metrics=Metrics()), kube  # type: ignore[arg-type]


def test_a_second_pass_over_an_unchanged_rljob_writes_nothing() -> None:
    # 180 idle RLJobs made ~65 requests/s: one PATCH per child and a status PATCH per pass.
    controller, kube = _setup()
    controller.reconcile_one("ml", "demo")
    first = kube.requests.copy()
    assert first["list"] == 0  # a new RLJob has no children yet: nothing to list
    # ConfigMap, NetworkPolicy, 2 Services and the StatefulSet applied; the key Secret and the Job
    # created. The ConfigMap twice: its record says the key is pending before the Secret's create.
    assert first["apply"] == 6 and first["create"] == 2 and first["patch_status"] == 1, dict(first)
    for _ in range(3):
        kube.requests.clear()
        controller.reconcile_one("ml", "demo")
        assert kube.writes() == 0, dict(kube.requests)
        assert kube.requests == {"get": 1, "list": len(CHILD_KINDS)}


def test_a_status_equal_up_to_nulls_is_not_patched_again() -> None:
    # Without metadata.generation the status holds nulls the API server drops on the way in: the
    # stored status never compared equal, so every pass sent a status PATCH.
    controller, kube = _setup(generation=None)
    controller.reconcile_one("ml", "demo")
    kube.requests.clear()
    controller.reconcile_one("ml", "demo")
    assert kube.requests["patch_status"] == 0, dict(kube.requests)
    assert _normalised({"a": None, "b": {"c": None, "d": 1}, "l": [{"x": None, "y": 2}]}) == {
        "b": {"d": 1},
        "l": [{"y": 2}],
    }


def test_a_changed_or_missing_child_is_applied_again_and_only_that_one() -> None:
    controller, kube = _setup()
    controller.reconcile_one("ml", "demo")
    del kube.objects[("Service", "demo-trainer")]  # deleted by hand
    kube.applied.clear()
    controller.reconcile_one("ml", "demo")
    assert kube.applied == [("Service", "demo-trainer")]

    rljob = kube.objects[("RLJob", "demo")]
    rljob["spec"]["model"]["path"] = "org/other-model"  # the rollout servers and the config change
    rljob["metadata"]["generation"] = 2
    kube.applied.clear()
    controller.reconcile_one("ml", "demo")
    assert ("ConfigMap", "demo-config") in kube.applied and ("StatefulSet", "demo-rollout") in kube.applied
    assert not [a for a in kube.applied if a[0] == "Service"], kube.applied  # their content is the same


def test_the_hash_annotation_says_whether_a_child_would_change() -> None:
    owner = [{"kind": "RLJob", "name": "demo", "uid": "u1", "controller": True}]
    obj = {"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ml", "ownerReferences": owner,
                                             "annotations": {"keep": "me"}}, "data": {"k": "v"}}  # fmt: skip
    a = stamped(obj)
    assert a["metadata"]["annotations"]["keep"] == "me" and len(a["metadata"]["annotations"][APPLIED_HASH]) == 32
    assert stamped(a) == a and "annotations" in obj["metadata"] and APPLIED_HASH not in obj["metadata"]["annotations"]
    live = copy.deepcopy(a)
    live["metadata"].update(resourceVersion="7", uid="x", managedFields=[{"manager": "rljob-operator"}])
    assert unchanged(a, live)  # what the API server adds does not count
    assert not unchanged(a, None)
    assert not unchanged(stamped({**obj, "data": {"k": "w"}}), live)
    other_owner = copy.deepcopy(live)
    other_owner["metadata"]["ownerReferences"][0]["uid"] = "u0"  # a child of an earlier RLJob of that name
    assert not unchanged(a, other_owner)
    going = copy.deepcopy(live)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not unchanged(a, going)


class _Response:
    def __init__(self, status: int, data: bytes) -> None:
        self.status, self.reason, self.data = status, "", data

    def read(self) -> None:
        pass


class _Client:
    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
        return (method, path)

    def call_api(self, method: str, path: str, **kwargs: Any) -> _Response:
        if path.endswith("/gone"):
            return _Response(404, b'{"message": "not found"}')
        return _Response(200, b'{"items": []}')


def test_every_request_is_counted_by_verb_resource_and_code() -> None:
    seen: list[tuple[str, str, int]] = []
    kube = Kube(_Client(), on_request=lambda *r: seen.append(r))  # type: ignore[arg-type]
    kube.children("Pod", "ml", "demo")
    assert kube.get("Job", "ml", "gone") is None
    kube.apply({"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ml"}})
    kube.patch_status("ml", "demo", {"phase": "Running"}, "1")
    assert seen == [("list", "pods", 200), ("get", "jobs", 404), ("get", "configmaps", 200),
                    ("apply", "configmaps", 200), ("patch_status", "rljobs", 200)]  # fmt: skip
    metrics = Metrics()
    metrics.api_request("apply", "configmaps", 200)
    value = metrics.registry.get_sample_value(
        "rljob_operator_api_requests_total", {"verb": "apply", "resource": "configmaps", "code": "200"}
    )
    assert value == 1.0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_watches_come_back_within_seconds_after_an_api_server_restart() -> None:
    # kopf's default delays (1, 1, 2, 3, 5, 8, 13, 21 s) left a new RLJob unseen for 57 s.
    settings = kopf.OperatorSettings()
    tune_watching(settings)
    backoffs = list(settings.networking.error_backoffs)  # type: ignore[arg-type]
    assert max(backoffs) <= 2.0 and 30.0 <= sum(backoffs) <= 120.0
    assert settings.watching.reconnect_backoff <= 1.0
    assert settings.watching.connect_timeout == settings.networking.connect_timeout == 5.0
    assert settings.watching.server_timeout is not None and settings.watching.client_timeout is not None
    assert settings.watching.server_timeout < settings.watching.client_timeout
