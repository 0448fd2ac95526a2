"""The one place that talks to the Kubernetes API (besides kopf's own watches).

A thin REST layer over the official client: server-side apply under one field
manager, create-if-missing, delete, list children by label, status patches and events.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from rljob_operator.applied import object_uid, owner_uid
from rljob_operator.kube_login import Credentials
from rljob_operator.models import GROUP, KIND, PLURAL, VERSION
from rljob_operator.names import LABEL_RLJOB, MANAGED_BY
from rljob_operator.network import with_fresh_key
from rljob_operator.wire import loads

FIELD_MANAGER = MANAGED_BY
# (connect, read) seconds: a frozen API server must not pin the reconcile workers for ever;
# a timed-out call is retried by the work queue like any other failed reconcile.
REQUEST_TIMEOUT = (5.0, 30.0)
# Objects whose ownership was checked, at most this many remembered (then it starts over:
# forgetting costs one GET per child, remembering for ever would grow with every RLJob seen).
MAX_REMEMBERED_OWNERS = 8192
# kind -> (API prefix, plural)
_PATHS = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Secret": ("/api/v1", "secrets"),
    "Job": ("/apis/batch/v1", "jobs"),
    "Node": ("/api/v1", "nodes"),
    KIND: (f"/apis/{GROUP}/{VERSION}", PLURAL),
}


class Conflict(Exception):
    """The API server answered 409 (a concurrent writer); retry later."""


class _Replaced(Exception):
    """A forced apply's uid precondition failed: the object checked is gone or was replaced."""


class NotOurs(Exception):
    """A child's name is taken by an object this RLJob did not create."""

    def __init__(self, kind: str, name: str, owner: str | None) -> None:
        self.kind, self.name = kind, name
        whose = f"owned by another object (uid {owner})" if owner else "not created by the operator"
        super().__init__(
            f"{kind} {name} already exists and is {whose}; it is left untouched. Fix: rename the RLJob, "
            f"or delete or rename that {kind}"
        )


# (verb, resource, HTTP status or 0 when no answer came): one call per request sent
OnRequest = Callable[[str, str, int], None]


class Kube:
    def __init__(self, client: ApiClient, *, in_cluster: bool = False, on_request: OnRequest | None = None) -> None:
        self.client = client
        self.in_cluster = in_cluster  # in a pod, kopf reads the (rotating) ServiceAccount token itself
        self.on_request: OnRequest = on_request or (lambda verb, resource, code: None)
        # (kind, ns, name) -> (owner uid, object uid) of the children whose ownership was checked
        self._checked: dict[tuple[str, str, str], tuple[str | None, str]] = {}

    def credentials(self) -> Credentials:
        c = self.client.configuration
        token = (c.api_key or {}).get("authorization") or (c.api_key or {}).get("BearerToken")
        if token and token.lower().startswith("bearer "):
            token = token[7:]
        return Credentials(
            server=c.host,
            ca_path=c.ssl_ca_cert,
            insecure=not c.verify_ssl,
            token=token,
            certificate_path=c.cert_file,
            private_key_path=c.key_file,
        )

    # -- raw REST ------------------------------------------------------------

    def _call(
        self,
        verb: str,
        kind: str,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        params = self.client.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.client.call_api(*params, _request_timeout=REQUEST_TIMEOUT)
            response.read()  # type: ignore[no-untyped-call]
        except Exception:
            self.on_request(verb, _PATHS[kind][1], 0)
            raise
        self.on_request(verb, _PATHS[kind][1], response.status)
        if not 200 <= response.status < 300:
            if response.status == 409:
                raise Conflict(f"{method} {path}: {response.data!r}")
            raise ApiException(status=response.status, reason=response.reason, body=response.data)
        data: Any = loads(response.data) if response.data else {}  # never deeper than wire.MAX_WIRE_DEPTH
        return data

    @staticmethod
    def _path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = _PATHS[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    # -- reads -----------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self._call("get", kind, "GET", self._path(kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return obj

    def node_gpu_mib(self, selector: Mapping[str, str]) -> int | None:
        """The smallest ``nvidia.com/gpu.memory`` label (MiB) of the nodes ``selector`` picks;
        None when none carries it or nodes cannot be listed (no RBAC grant: no memory check)."""
        from rljob_operator.gpu_memory import smallest_node_gpu_mib

        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in selector.items()))] if selector else []
        try:
            data = self._call("list", "Node", "GET", "/api/v1/nodes", query=query)
        except ApiException:
            return None
        return smallest_node_gpu_mib(data.get("items") or [], selector)

    def children(self, kind: str, namespace: str, rljob: str) -> list[dict[str, Any]]:
        selector = f"{LABEL_RLJOB}={rljob},app.kubernetes.io/managed-by={MANAGED_BY}"
        data = self._call("list", kind, "GET", self._path(kind, namespace), query=[("labelSelector", selector)])
        items: list[dict[str, Any]] = data.get("items") or []
        for item in items:
            item.setdefault("kind", kind)  # list responses leave it out
        return items

    # -- writes ----------------------------------------------------------------

    def apply(self, obj: dict[str, Any], live: dict[str, Any] | None = None) -> dict[str, Any]:
        """Server-side apply: creates or updates, one field manager, idempotent; but never an
        object someone else made. A forced apply would take over an existing ``app-config``
        ConfigMap, give it this RLJob as owner, and the garbage collector would delete it with
        the RLJob: an object of that name that this RLJob does not own is :class:`NotOurs`.

        ``live`` is the object as the caller listed it among this RLJob's children (None: not
        among them). Ownership is checked (one GET) the first time, and again whenever ``live``
        is missing or its uid is not the one checked: a ConfigMap deleted and created again by
        someone else (``kubectl replace --force``) is a new object. The forced apply carries the
        checked uid, a precondition the API server enforces, so an object replaced between the
        check and the write is refused, never taken over. An object that does not exist is
        created by an apply without force (a foreign one made meanwhile conflicts instead of
        being taken). A steady state costs one request per changed child."""
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        owner = owner_uid(obj)
        seen = object_uid(live) if live is not None and owner_uid(live) == owner else None
        if seen is not None and self._checked.get(key) == (owner, seen):
            try:
                return self._apply(obj, seen)
            except _Replaced:
                self._checked.pop(key, None)  # replaced since it was listed: check again
        uid = self._check(obj)
        if uid is None:
            try:
                result = self._apply(obj, None)
            except Conflict:
                uid = self._check(obj)  # created meanwhile: NotOurs unless it is ours
                if uid is None:
                    raise
            else:
                self._remember(key, owner, object_uid(result))
                return result
        self._remember(key, owner, uid)
        try:
            return self._apply(obj, uid)
        except _Replaced:
            self._checked.pop(key, None)
            replaced = f"{obj['kind']} {meta['name']} was replaced while it was applied; checked again next pass"
            raise Conflict(replaced) from None

    def _check(self, obj: dict[str, Any]) -> str | None:
        """The uid of the live object of ``obj``'s name if this RLJob owns it, None if there is
        none; :class:`NotOurs` if it belongs to someone else."""
        meta = obj["metadata"]
        current = self.get(obj["kind"], meta["namespace"], meta["name"])
        if current is None:
            return None
        if owner_uid(current) != owner_uid(obj):
            raise NotOurs(obj["kind"], meta["name"], owner_uid(current))
        return object_uid(current)

    def _remember(self, key: tuple[str, str, str], owner: str | None, uid: str | None) -> None:
        if len(self._checked) >= MAX_REMEMBERED_OWNERS:
            self._checked.clear()
        if uid:
            self._checked[key] = (owner, uid)

    def _apply(self, obj: dict[str, Any], uid: str | None) -> dict[str, Any]:
        """One apply request: forced onto the object with ``uid`` (the API server refuses it if
        that object is gone or was replaced: :class:`_Replaced`), or, with no uid, an unforced
        one that creates the object."""
        meta = obj["metadata"]
        body = {**obj, "metadata": {**meta, "uid": uid}} if uid else obj
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")] if uid else [("fieldManager", FIELD_MANAGER)]
        try:
            # Serialised here as UTF-8 JSON (valid YAML): the client's own json.dumps escapes non-ASCII
            # as \uXXXX surrogate pairs, which the API server's YAML reader refuses (an emoji in
            # model.path answered 400 on every pass).
            result: dict[str, Any] = self._call(
                "apply",
                obj["kind"],
                "PATCH",
                self._path(obj["kind"], meta["namespace"], meta["name"]),
                body=json.dumps(body, ensure_ascii=False).encode(),
                query=query,
                content_type="application/apply-patch+yaml",
            )
        except Conflict:
            if uid:
                raise _Replaced from None  # "uid mismatch": no object of that name any more
            raise
        except ApiException as exc:
            if uid and exc.status == 422 and "metadata.uid" in str(exc.body):
                raise _Replaced from None  # another object now has that name
            raise
        return result

    def create_if_missing(self, obj: dict[str, Any]) -> bool:
        """Create ``obj``; an existing object of the same name is left as is if this RLJob owns it
        (created by an earlier pass, or a restarted operator), else :class:`NotOurs`. True if created."""
        meta = obj["metadata"]
        try:
            self._call("create", obj["kind"], "POST", self._path(obj["kind"], meta["namespace"]), body=obj,
                       query=[("fieldManager", FIELD_MANAGER)])  # fmt: skip
        except Conflict:
            current = self.get(obj["kind"], meta["namespace"], meta["name"])
            if current is not None and owner_uid(current) != owner_uid(obj):
                raise NotOurs(obj["kind"], meta["name"], owner_uid(current)) from None
            return False
        return True

    def create_key(self, obj: dict[str, Any]) -> bool:
        """POST the RLJob's key Secret with a fresh random key: True if created, False if a Secret of
        that name exists (409). Never rewritten; whose it is, operator/rljob_operator/key_secret.py decides."""
        meta = obj["metadata"]
        try:
            self._call("create", "Secret", "POST", self._path("Secret", meta["namespace"]), body=with_fresh_key(obj),
                       query=[("fieldManager", FIELD_MANAGER)])  # fmt: skip
        except Conflict:
            return False
        return True

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        """Delete the object; with ``uid``, only that object (a precondition the API server
        checks): one that replaced it under the same name, someone else's, is left alone."""
        # Background propagation: the garbage collector removes the pods.
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("delete", kind, "DELETE", self._path(kind, namespace, name), body=body)
        except Conflict:
            if not uid:
                raise  # the precondition failed: not the object that was meant, nothing deleted
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: dict[str, Any], resource_version: str) -> str:
        """Replace the status; ``resource_version`` makes a concurrent change a Conflict. Returns
        the RLJob's new resourceVersion."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        written: dict[str, Any] = self._call(
            "patch_status",
            KIND,
            "PATCH",
            self._path(KIND, namespace, name, "status"),
            body=json.loads(json.dumps(body)),
            content_type="application/merge-patch+json",
        )
        return str((written.get("metadata") or {}).get("resourceVersion", resource_version))

    def event(self, rljob: dict[str, Any], kind: str, reason: str, message: str) -> None:
        meta = rljob["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": kind,
            "reason": reason,
            "message": message[:1024],  # the API limit is larger; keep events readable
            "source": {"component": MANAGED_BY},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self._call("create", "Event", "POST", self._path("Event", meta["namespace"]), body=body)
