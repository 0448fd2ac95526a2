"""The rollout servers' key Secret: the operator never adopts a ``NAME-api-key`` it did not create,
and uses a Secret the RLJob names (``spec.apiKeySecret``) as is.

The controller and the real API layer (operator/rljob_operator/kube.py) run over an in-memory stand-in for the
API server's REST interface (no API server runs here; tests/cluster/test_operator_ownership.py
runs the same case on the real control plane). Like the operator's RBAC, the stand-in lets the
operator create Secrets but never read them: a GET or list of Secrets fails the test.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.controller import Controller
from rljob_operator.kube import Kube
from rljob_operator.metrics import Metrics
from rljob_operator.plan import plan
from rljob_operator.record import ANNOTATION_STATE, read_memory

ROOT = Path(__file__).resolve().parents[2]
NS = "ml"


class _Response:
    def __init__(self, status: int, body: Any) -> None:
        self.status, self.reason = status, "OK" if status < 300 else "Error"
        self.data = json.dumps(body).encode()

    def read(self) -> None:
        pass


class _FakeApiServer:
    """Stands in for kubernetes.client.ApiClient: objects by REST path, POST answered 409 for a
    name that exists, server-side apply with the uid precondition, merge-patched status, events."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}  # object path -> object
        self.events: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self._ids = itertools.count(1)

    def put(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` (as ``kubectl create`` would) and return it with its uid."""
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{next(self._ids)}")
        obj["metadata"]["resourceVersion"] = str(next(self._ids))
        self.objects[f"{collection}/{obj['metadata']['name']}"] = obj
        return obj

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
        headers = kwargs.get("header_params") or {}
        return (method, path, dict(kwargs.get("query_params") or []), headers.get("Content-Type"), kwargs.get("body"))

    def call_api(self, method: str, path: str, query: dict[str, str], content: str, body: Any, **_: Any) -> _Response:
        self.requests.append((method, path))
        assert "/secrets" not in path or method == "POST", f"the operator may only create Secrets: {method} {path}"
        body = json.loads(body) if isinstance(body, bytes) else copy.deepcopy(body)
        if method == "GET" and path in self.objects:
            return _Response(200, self.objects[path])
        if method == "GET" and path.rsplit("/", 1)[-1] in _COLLECTIONS:
            wanted = dict(term.split("=") for term in query.get("labelSelector", "").split(",") if term)
            items = [o for p, o in self.objects.items() if p.rsplit("/", 1)[0] == path
                     and wanted.items() <= (o["metadata"].get("labels") or {}).items()]  # fmt: skip
            return _Response(200, {"items": items})
        if method == "POST" and path.endswith("/events"):
            self.events.append(body)
            return _Response(201, body)
        if method == "POST":
            if f"{path}/{body['metadata']['name']}" in self.objects:
                return _Response(409, {"message": "already exists", "reason": "AlreadyExists"})
            return _Response(201, self.put(path, body))
        if method == "PATCH" and path.endswith("/status"):
            obj = self.objects[path.removesuffix("/status")]
            obj["status"] = _merged(obj.get("status") or {}, body["status"])
            obj["metadata"]["resourceVersion"] = str(next(self._ids))
            return _Response(200, obj)
        if method == "PATCH":  # server-side apply
            live = self.objects.get(path)
            if live is not None and body["metadata"].get("uid") != live["metadata"]["uid"]:
                return _Response(409, {"message": "conflict"})
            body["metadata"]["uid"] = live["metadata"]["uid"] if live else None
            if live is None:
                del body["metadata"]["uid"]
            return _Response(200, self.put(path.rsplit("/", 1)[0], body))
        if method == "DELETE" and path in self.objects:
            del self.objects[path]
            return _Response(200, {})
        return _Response(404, {"message": f"{path} not found"})


def _merged(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch applied (null removes a member)."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


_COLLECTIONS = {"configmaps", "services", "pods", "statefulsets", "networkpolicies", "jobs", "secrets", "nodes"}
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
RLJOBS = f"/apis/treetrain.dev/v1alpha1/namespaces/{NS}/rljobs"


def _cluster(spec: dict[str, Any] | None = None) -> tuple[_FakeApiServer, dict[str, Any]]:
    api = _FakeApiServer()
    rljob = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    rljob["metadata"] = {"name": "demo", "namespace": NS, "generation": 1}
    rljob["spec"].update(spec or {})
    return api, api.put(RLJOBS, rljob)


def _pass(api: _FakeApiServer, controller: Controller | None = None) -> Controller:
    controller = controller or Controller(kube=Kube(api), metrics=Metrics())  # type: ignore[arg-type]
    controller.reconcile_one(NS, "demo")
    return controller


def _status(api: _FakeApiServer) -> dict[str, Any]:
    return dict(api.objects[f"{RLJOBS}/demo"].get("status") or {})


def _condition(api: _FakeApiServer, kind: str) -> dict[str, Any] | None:
    return next((c for c in _status(api).get("conditions") or [] if c["type"] == kind), None)


def _kinds(api: _FakeApiServer) -> set[str]:
    return {o.get("kind", "") for p, o in api.objects.items() if not p.startswith(RLJOBS)}


def _foreign_key() -> dict[str, Any]:
    return {
        "kind": "Secret",
        "metadata": {"name": "demo-api-key", "namespace": NS},
        "data": {"api-key": "Zm9yZWlnbg=="},
    }


def test_a_key_secret_made_before_the_rljob_is_refused_named_and_left_alone() -> None:
    # Hostile-user review: a Secret "demo-api-key" created before the RLJob silently became its key
    # (the create answered 409 and the operator took it as its own), and was never owned.
    api, _ = _cluster()
    foreign = api.put(SECRETS, _foreign_key())
    _pass(api)
    refused = _condition(api, "ReconcileError")
    assert refused is not None and refused["status"] == "True", _status(api)
    message = refused["message"]
    assert "Secret demo-api-key" in message and "spec.apiKeySecret" in message, message
    assert "delete" in message and "rename" in message, message
    warnings = [e for e in api.events if e["type"] == "Warning" and "Secret demo-api-key" in e["message"]]
    assert warnings, [e["message"] for e in api.events]
    # Nothing that would read the key exists, and the Secret is as its author made it.
    assert not _kinds(api) & {"StatefulSet", "Job"}, _kinds(api)
    assert api.objects[f"{SECRETS}/demo-api-key"] == foreign
    # Removed: the operator makes its own key, the refusal clears, pods follow.
    for _ in range(2):  # again, by a restarted operator: the refusal is recorded, never forgotten
        _pass(api)
        assert (_condition(api, "ReconcileError") or {})["status"] == "True", _status(api)
        assert api.objects[f"{SECRETS}/demo-api-key"] == foreign and not _kinds(api) & {"StatefulSet", "Job"}
    del api.objects[f"{SECRETS}/demo-api-key"]
    _pass(api)
    ours = api.objects[f"{SECRETS}/demo-api-key"]
    assert [r["uid"] for r in ours["metadata"]["ownerReferences"]] == [api.objects[f"{RLJOBS}/demo"]["metadata"]["uid"]]
    assert (_condition(api, "ReconcileError") or {}).get("status") != "True", _status(api)
    assert {"StatefulSet", "Job", "ConfigMap"} <= _kinds(api)


def test_the_operators_own_key_is_recognised_after_a_restart_without_reading_it() -> None:
    # The operator cannot read Secrets: what it created is in its record on NAME-config.
    api, _ = _cluster()
    _pass(api)
    config = api.objects[f"/api/v1/namespaces/{NS}/configmaps/demo-config"]
    assert read_memory(config).key == "created", config["metadata"]["annotations"]
    key = copy.deepcopy(api.objects[f"{SECRETS}/demo-api-key"])
    for _ in range(2):  # a restarted operator: a fresh process posts the Secret once, is told 409
        api.requests.clear()
        _pass(api)
        assert (_condition(api, "ReconcileError") or {}).get("status") != "True", _status(api)
        assert [r for r in api.requests if r[0] != "GET"] == [("POST", SECRETS)], api.requests
    assert api.objects[f"{SECRETS}/demo-api-key"] == key


def test_a_key_created_by_a_pass_that_died_before_recording_it_is_still_the_operators() -> None:
    # The Secret's create answered 201, then the operator died before the ConfigMap said so: the
    # record written before the create (pending) makes the restarted operator's 409 its own.
    api, _ = _cluster()
    real = api.call_api
    config_path = f"/api/v1/namespaces/{NS}/configmaps/demo-config"

    def dies_after_the_key(method: str, path: str, *args: Any, **kwargs: Any) -> _Response:
        if method == "PATCH" and path == config_path and f"{SECRETS}/demo-api-key" in api.objects:
            raise SystemExit("operator killed")  # not an Exception: nothing in the pass catches it
        return real(method, path, *args, **kwargs)

    api.call_api = dies_after_the_key  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        _pass(api)
    api.call_api = real  # type: ignore[method-assign]
    assert read_memory(api.objects[config_path]).key == "pending"
    assert f"{SECRETS}/demo-api-key" in api.objects and "Job" not in _kinds(api)
    _pass(api)  # a new operator
    assert (_condition(api, "ReconcileError") or {}).get("status") != "True", _status(api)
    assert read_memory(api.objects[config_path]).key == "created"
    assert {"StatefulSet", "Job"} <= _kinds(api)


def test_a_key_secret_made_by_an_operator_before_the_record_is_kept() -> None:
    # RLJobs reconciled by an operator that kept no record of its key: their Secret stays theirs.
    api, _ = _cluster()
    _pass(api)
    config = api.objects[f"/api/v1/namespaces/{NS}/configmaps/demo-config"]
    config["metadata"]["annotations"][ANNOTATION_STATE] = '{"restarts":0}'
    _pass(api)
    assert (_condition(api, "ReconcileError") or {}).get("status") != "True", _status(api)
    assert read_memory(api.objects[f"/api/v1/namespaces/{NS}/configmaps/demo-config"]).key == "created"


def _key_refs(api: _FakeApiServer) -> list[dict[str, Any]]:
    refs = []
    for obj in api.objects.values():
        template = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
        for container in template.get("containers") or []:
            refs += [e["valueFrom"]["secretKeyRef"] for e in container.get("env") or []
                     if "secretKeyRef" in (e.get("valueFrom") or {})]  # fmt: skip
    return refs


def test_a_secret_named_in_spec_api_key_secret_is_used_as_is() -> None:
    api, _ = _cluster({"apiKeySecret": {"name": "team-key", "key": "token"}})
    team = api.put(SECRETS, {"kind": "Secret", "metadata": {"name": "team-key", "namespace": NS},
                             "data": {"token": "dGVhbQ=="}})  # fmt: skip
    foreign = api.put(SECRETS, _foreign_key())  # not the key here: neither used nor refused
    controller = _pass(api)
    _pass(api, controller)
    assert (_condition(api, "ReconcileError") or {}).get("status") != "True", _status(api)
    assert not [r for r in api.requests if "/secrets" in r[1]], "the named Secret is never created or changed"
    assert api.objects[f"{SECRETS}/team-key"] == team and api.objects[f"{SECRETS}/demo-api-key"] == foreign
    refs = _key_refs(api)
    assert {"StatefulSet", "Job"} <= _kinds(api) and refs
    assert all(r == {"name": "team-key", "key": "token"} for r in refs), refs
    # Deleting the RLJob's children never names it either.
    assert all("team-key" not in path for method, path in api.requests if method == "DELETE")


def test_the_plan_renders_no_secret_for_a_named_one_and_defaults_its_key() -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    manifest["spec"]["apiKeySecret"] = {"name": "team-key"}
    objects = plan(manifest).objects
    assert not [o for o in objects if o["kind"] == "Secret"]
    refs = [e["valueFrom"]["secretKeyRef"] for o in objects if o["kind"] in ("StatefulSet", "Job")
            for c in o["spec"]["template"]["spec"]["containers"] for e in c.get("env") or []
            if "secretKeyRef" in (e.get("valueFrom") or {})]  # fmt: skip
    assert refs and all(r == {"name": "team-key", "key": "api-key"} for r in refs), refs


def test_the_record_of_the_key_reads_back_and_an_older_record_keeps_its_key() -> None:
    def config(note: str | None) -> dict[str, Any]:
        notes = {ANNOTATION_STATE: note} if note is not None else {}
        return {"kind": "ConfigMap", "metadata": {"name": "demo-config", "annotations": notes}}

    made = config('{"key":"created","restarts":2}')
    assert read_memory(made).key == "created" and read_memory(made).restarts == 2
    assert read_memory(config('{"key":"pending","restarts":0}')).key == "pending"
    assert read_memory(config(None)).key == "none" and read_memory(None).key == "none"  # a new RLJob
    assert read_memory(config('{"restarts":1}')).key == "created"  # written before the entry existed
    assert read_memory(config('{"key":"yes"}')).key == "none"  # nonsense is no claim
    assert json.loads(read_memory(made).annotation())["key"] == "created"
