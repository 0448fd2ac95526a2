"""The least-privilege RBAC rules the operator needs: exactly the calls in kube.py and the
watches in handlers.py, plus what kopf itself observes. tests/cluster/test_operator.py runs the operator
with a token bound to these rules only; the Helm chart ships the same rules."""

from __future__ import annotations

from typing import Any

from rljob_operator.models import GROUP, PLURAL

_WATCH = ["get", "list", "watch"]

RULES: list[dict[str, Any]] = [
    # RLJobs: watched, read fresh, deleted after their TTL; the status is ours to write.
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": [*_WATCH, "delete"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    # Children: server-side applied (patch; create when new), watched; Jobs are only created
    # (their pod template is immutable) and deleted on restart; a removed engine's StatefulSet
    # and Service are deleted.
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": [*_WATCH, "create", "patch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": [*_WATCH, "create", "patch", "delete"]},
    {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": [*_WATCH, "create", "patch", "delete"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": [*_WATCH, "create", "delete"]},
    # Each RLJob's NetworkPolicy: server-side applied and watched like the other children.
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": [*_WATCH, "create", "patch"]},
    # Each RLJob's API-key Secret: created once, never read (reading would expose every Secret of
    # the namespace), never rewritten; the garbage collector deletes it with the RLJob.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    # Pods are only observed (phase, scheduling, failures).
    {"apiGroups": [""], "resources": ["pods"], "verbs": _WATCH},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # With --namespace, kopf observes namespaces and CRDs to follow them as they come and go.
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    # Admission's memory plan reads the nvidia.com/gpu.memory label of the nodes an RLJob can
    # land on (cluster-scoped: listed, never watched or changed).
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
]
