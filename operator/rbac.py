"""The least-privilege RBAC rules the operator needs: exactly the calls in kube.py and the
watches in handlers.py. The Helm chart ships these rules; a test checks they match."""

from __future__ import annotations

from typing import Any

from rljob_operator.models import GROUP, PLURAL

_WATCH = ["get", "list", "watch"]

RULES: list[dict[str, Any]] = [
    # RLJobs: watched, read fresh, deleted after their TTL; the status is ours to write.
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": [*_WATCH, "delete"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    # Children: server-side applied (patch), created once (Jobs), deleted on suspend/restart.
    {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": [*_WATCH, "create", "patch"]},
    {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": [*_WATCH, "create", "patch", "delete"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": [*_WATCH, "create", "patch", "delete"]},
    # Pods are only observed (phase, scheduling, failures).
    {"apiGroups": [""], "resources": ["pods"], "verbs": _WATCH},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # kopf checks which namespaces exist when it watches a list of them.
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # kopf discovers CRDs to resolve the RLJob resource.
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
]
