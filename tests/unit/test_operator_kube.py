"""The operator's API client layer (operator/rljob_operator/kube.py) and listener defaults, without a cluster:
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
    client = _Scripted(None)
    kube = Kube(client)  # type: ignore[arg-type]
    obj = {"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ml"}, "data": {"model": "Qwen/😀-é"}}
    kube.apply(obj)
    (body,) = client.bodies
    assert isinstance(body, bytes) and "😀".encode() in body and b"\\ud83d" not in body
    assert json.loads(body) == obj


def test_rbac_grants_exactly_the_calls_the_code_makes() -> None:
    """The verbs each kind needs, from what the operator does with it (kube.py, controller.py):
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
    """A fake client that answers GETs with a given object (or 404), PATCHes with the object
    written (with a uid), and records the calls and queries."""

    def __init__(self, existing: dict[str, Any] | None) -> None:
        super().__init__()
        self.existing = existing
        self.methods: list[str] = []
        self.queries: list[dict[str, str]] = []

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
        self.methods.append(method)
        self.queries.append(dict(kwargs.get("query_params") or []))
        return super().param_serialize(method, path, **kwargs)

    def call_api(self, *args: Any, **kwargs: Any) -> _Response:
        response = _Response()
        if args[0] == "GET":
            if self.existing is None:
                response.status, response.data = 404, b'{"message": "not found"}'
            else:
                response.data = json.dumps(self.existing).encode()
        elif args[0] == "PATCH":
            written = json.loads(args[3])
            written["metadata"].setdefault("uid", "new-uid")
            response.data = json.dumps(written).encode()
        return response


def _child(uid: str | None, object_uid: str = "cm-1") -> dict[str, Any]:
    refs = [{"apiVersion": "treetrain.dev/v1alpha1", "kind": "RLJob", "name": "app", "uid": uid, "controller": True}]
    return {
        "kind": "ConfigMap",
        "metadata": {"name": "app-config", "namespace": "ml", "uid": object_uid,
                     "ownerReferences": refs if uid else []},
    }  # fmt: skip


def _desired() -> dict[str, Any]:
    obj = _child("rljob-uid")
    del obj["metadata"]["uid"]
    return obj


def test_apply_never_takes_over_an_object_it_did_not_create() -> None:
    # A forced apply took over ConfigMap "app-config" of someone else, gave it the RLJob as owner,
    # and the garbage collector deleted it with the RLJob.
    for existing in (_child(None), _child("someone-else")):
        client = _Scripted(existing)
        kube = Kube(client)  # type: ignore[arg-type]
        with pytest.raises(NotOurs, match="ConfigMap app-config already exists"):
            kube.apply(_desired(), None)
        assert client.methods == ["GET"]  # nothing written
    ours = _child("rljob-uid")
    client = _Scripted(ours)  # ours: applied, checked once while it is listed with the same uid
    kube = Kube(client)  # type: ignore[arg-type]
    kube.apply(_desired(), ours)
    kube.apply(_desired(), ours)
    assert client.methods == ["GET", "PATCH", "PATCH"]
    # Every forced apply names the uid that was checked: the API server refuses it for another object.
    assert [json.loads(b)["metadata"]["uid"] for b in client.bodies] == ["cm-1", "cm-1"]
    assert client.queries[1]["force"] == "true"
    new = _Scripted(None)  # not there yet: created by an apply without force
    Kube(new).apply(_desired(), None)  # type: ignore[arg-type]
    assert new.methods == ["GET", "PATCH"] and "force" not in new.queries[1]
    assert "uid" not in json.loads(new.bodies[0])["metadata"]


def test_a_child_deleted_and_made_again_by_someone_else_is_checked_again() -> None:
    """Issue 21 item 5: `kubectl replace --force` (delete, create) of the ConfigMap: the operator
    had checked the name once, remembered it, and force-applied onto the new, foreign object."""
    ours = _child("rljob-uid")
    client = _Scripted(ours)
    kube = Kube(client)  # type: ignore[arg-type]
    kube.apply(_desired(), ours)
    client.existing = _child(None, object_uid="cm-2")  # replaced by someone else's
    for listed in (None, _child(None, object_uid="cm-2")):  # not among the RLJob's children: re-checked
        client.methods.clear()
        with pytest.raises(NotOurs):
            kube.apply(_desired(), listed)
        assert client.methods == ["GET"]
    # Replaced by another object that names this RLJob as its controller (a copy of ours): it is
    # ours, and checked once under its new uid.
    copy = _child("rljob-uid", object_uid="cm-3")
    client.existing, client.methods = copy, []
    kube.apply(_desired(), copy)
    kube.apply(_desired(), copy)
    assert client.methods == ["GET", "PATCH", "PATCH"]
    assert json.loads(client.bodies[-1])["metadata"]["uid"] == "cm-3"


def test_a_delete_names_the_uid_it_means() -> None:
    client = _Scripted(None)
    Kube(client).delete("Job", "ml", "demo-trainer", "job-1")  # type: ignore[arg-type]
    (body,) = client.bodies
    assert body["preconditions"] == {"uid": "job-1"} and body["propagationPolicy"] == "Background"
