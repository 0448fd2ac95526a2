"""The operator's API client layer (operator/kube.py) and listener defaults, without a cluster:
a fake client records what would be sent (no API server runs here)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rljob_operator.cli import default_bind
from rljob_operator.kube import REQUEST_TIMEOUT, Kube, NotOurs


class _Response:
    status = 200
    reason = "OK"
    data = b'{"items": []}'

    def read(self) -> None:
        pass


class _FakeClient:
    """Stands in for kubernetes.client.ApiClient: records every call's keyword arguments."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.bodies: list[Any] = []

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
        if kwargs.get("body") is not None:
            self.bodies.append(kwargs["body"])
        return (method, path, kwargs.get("header_params"), kwargs.get("body"), None)

    def call_api(self, *args: Any, **kwargs: Any) -> _Response:
        self.calls.append(kwargs)
        return _Response()


def test_every_api_call_has_a_timeout() -> None:
    # A frozen API server once pinned every reconcile worker: no call may wait for ever.
    client = _FakeClient()
    kube = Kube(client)  # type: ignore[arg-type]
    kube.children("Pod", "ml", "demo")
    kube.get("RLJob", "ml", "demo")
    assert client.calls and all(c.get("_request_timeout") == REQUEST_TIMEOUT for c in client.calls)
    connect, read = REQUEST_TIMEOUT
    assert 0 < connect <= 10 and 0 < read <= 60


def test_listeners_bind_loopback_outside_a_pod() -> None:
    assert default_bind({}) == "127.0.0.1"
    assert default_bind({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "0.0.0.0"


def test_apply_sends_utf8_never_surrogate_escapes() -> None:
    client = _FakeClient()
    kube = Kube(client)  # type: ignore[arg-type]
    obj = {"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ml"}, "data": {"model": "Qwen/😀-é"}}
    kube.apply(obj)
    (body,) = client.bodies
    assert isinstance(body, bytes) and "😀".encode() in body and b"\\ud83d" not in body
    assert json.loads(body) == obj


def test_rbac_grants_exactly_the_calls_the_code_makes() -> None:
    """The verbs each kind needs, from what the operator does with it (kube.py, handlers.py):
    server-side apply (patch, and create for a new object), create-only (Jobs), delete, reads
    (get/list) and kopf's watches. Nothing more: a verb no code uses is a grant to remove."""
    from rljob_operator.rbac import RULES

    applied = {"configmaps", "services", "statefulsets"}  # Decision.apply kinds
    created = {"jobs"}  # Decision.create_only
    deleted = {"jobs", "statefulsets", "services", "rljobs"}  # restarts, suspend, TTL, a removed engine
    watched = {"rljobs", "pods", "jobs", "statefulsets", "services", "configmaps"}  # kopf handlers
    expected: dict[str, set[str]] = {}
    for kinds, verbs in ((applied, {"patch", "create"}), (created, {"create"}), (deleted, {"delete"}),
                         (watched, {"get", "list", "watch"})):  # fmt: skip
        for kind in kinds:
            expected.setdefault(kind, set()).update(verbs)
    granted = {res: set(rule["verbs"]) for rule in RULES for res in rule["resources"] if res in expected}
    assert granted == expected


class _Scripted(_FakeClient):
    """A fake client that answers GETs with a given object (or 404) and records the calls."""

    def __init__(self, existing: dict[str, Any] | None) -> None:
        super().__init__()
        self.existing = existing
        self.methods: list[str] = []

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
        self.methods.append(method)
        return super().param_serialize(method, path, **kwargs)

    def call_api(self, *args: Any, **kwargs: Any) -> _Response:
        response = _Response()
        if args[0] == "GET":
            if self.existing is None:
                response.status, response.data = 404, b'{"message": "not found"}'
            else:
                response.data = json.dumps(self.existing).encode()
        return response


def _child(uid: str | None) -> dict[str, Any]:
    refs = [{"apiVersion": "treetrain.dev/v1alpha1", "kind": "RLJob", "name": "app", "uid": uid, "controller": True}]
    return {
        "kind": "ConfigMap",
        "metadata": {"name": "app-config", "namespace": "ml", "ownerReferences": refs if uid else []},
    }


def test_apply_never_takes_over_an_object_it_did_not_create() -> None:
    # A forced apply took over ConfigMap "app-config" of someone else, gave it the RLJob as owner,
    # and the garbage collector deleted it with the RLJob.
    for existing in (_child(None), _child("someone-else")):
        client = _Scripted(existing)
        kube = Kube(client)  # type: ignore[arg-type]
        with pytest.raises(NotOurs, match="ConfigMap app-config already exists"):
            kube.apply(_child("rljob-uid"))
        assert client.methods == ["GET"]  # nothing written
    client = _Scripted(_child("rljob-uid"))  # ours: applied, and checked only once
    kube = Kube(client)  # type: ignore[arg-type]
    kube.apply(_child("rljob-uid"))
    kube.apply(_child("rljob-uid"))
    assert client.methods == ["GET", "PATCH", "PATCH"]
    new = _Scripted(None)  # not there yet: created by the apply
    Kube(new).apply(_child("rljob-uid"))  # type: ignore[arg-type]
    assert new.methods == ["GET", "PATCH"]
