"""What the Kubernetes API, its controllers and the rollout servers would refuse or run, checked
before anything is created. Pure: plain data in, ``(field path, message)`` problems out.

Three kinds of rule:

- values the API validates in the pod spec (``spec.scheduling``, claim names, the GPU resource
  name), so an RLJob the API would refuse a child of gets ``Valid=False`` with the field to fix;
- every child name and every label value the children *and their controllers* carry: a
  StatefulSet's pods get ``controller-revision-hash: <statefulset>-<hash of up to 10>`` and
  hostnames ``<statefulset>-<ordinal>``, an Indexed Job's pods ``batch.kubernetes.io/job-name:
  <job>`` and hostnames ``<job>-<index>``; each is at most 63 characters, or the controller cannot
  create the pods and nothing says why;
- what the rollout servers execute: a model path that is a flag or escapes its volume, and,
  when the operator runs with allow-lists, any server flag not known to load no code.

Image prefixes match whole path segments: ``ghcr.io/treetrain`` allows ``ghcr.io/treetrain/x``
and ``ghcr.io/treetrain:1``, never ``ghcr.io/treetrainevil/x``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from rljob_operator.servers import SAFE_SERVER_FLAGS

Problem = tuple[str, str]  # (field path, message)

LABEL_MAX = 63  # label values, label names, DNS labels (hostnames, Service names)
SUBDOMAIN_MAX = 253
REVISION_HASH_MAX = 10  # controller-revision-hash: <statefulset>-<ComputeHash>, a uint32 safe-encoded
CONFIG_MAP_MAX_BYTES = 1 << 20  # the API's limit on a ConfigMap's data

_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


# ---------------------------------------------------------------------------
# Kubernetes value rules (the API's own, in the API's words where it has them)


def label_value_problem(value: str) -> str | None:
    if len(value) > LABEL_MAX:
        return f"is {len(value)} characters; a label value is at most {LABEL_MAX}"
    if not _LABEL_VALUE.fullmatch(value):
        return (
            "is not a valid label value: letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
        )
    return None


def subdomain_problem(value: str) -> str | None:
    if len(value) > SUBDOMAIN_MAX:
        return f"is {len(value)} characters; a DNS subdomain is at most {SUBDOMAIN_MAX}"
    if not _SUBDOMAIN.fullmatch(value):
        return (
            "is not a DNS subdomain: lower-case letters, digits, '-' and '.', starting and ending with a letter or "
            "digit"
        )
    return None


def qualified_name_problem(value: str) -> str | None:
    """A label key, nodeSelector key or taint key: ``[prefix/]name``, the prefix a DNS subdomain."""
    prefix, slash, name = value.rpartition("/")
    if slash and (not prefix or subdomain_problem(prefix)):
        return f"has a prefix {prefix!r} that is not a DNS subdomain (example.com/name)"
    if not name or len(name) > LABEL_MAX or not _NAME_PART.fullmatch(name):
        return (
            f"is not a qualified name: [prefix/]name, the name at most {LABEL_MAX} letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def extended_resource_problem(value: str) -> str | None:
    """GPUs are requested as an extended resource: ``domain/name``, not ``cpu``, ``memory`` or a
    ``kubernetes.io/`` resource (the API would read ``memory: 8`` as 8 bytes)."""
    if "/" not in value or "kubernetes.io/" in value:
        return (
            "is not an extended resource name (a device plugin's domain/name, e.g. nvidia.com/gpu or amd.com/gpu); "
            "cpu, memory and kubernetes.io/ resources are not GPUs"
        )
    if value.startswith("requests.") or qualified_name_problem(value):
        return "is not a valid extended resource name: domain/name, e.g. nvidia.com/gpu"
    return None


# The scale of each quantity suffix (resource.Quantity): binary, decimal; "1e3" is an exponent.
_QUANTITY_SCALE = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("", 0), ("k", 3), ("M", 6), ("G", 9),
                                        ("T", 12), ("P", 15), ("E", 18))},
}  # fmt: skip


def quantity_value(text: str) -> Decimal:
    """A quantity the RLJob model admitted (``500m``, ``64Gi``, ``1e3``) as a number."""
    number = re.match(r"[0-9]*\.?[0-9]*", text)
    digits = number.group() if number else ""
    suffix = text[len(digits) :]
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return Decimal(text)
    return Decimal(digits) * _QUANTITY_SCALE[suffix]


def resource_problems(path: str, requests: Mapping[str, str], limits: Mapping[str, str]) -> list[Problem]:
    """A container's request above its limit, which the API refuses."""
    found = []
    for key, request in requests.items():
        if key in limits and quantity_value(request) > quantity_value(limits[key]):
            found.append((f"{path}.requests.{key}", f"{request} is more than the limit {limits[key]}; the API refuses "
                                                    f"a request above its limit: lower it, or raise {path}.limits.{key}"))  # fmt: skip
    return found


def toleration_problems(path: str, toleration: Mapping[str, Any]) -> list[Problem]:
    """The pod spec's rules for one toleration (the API answers a wrong one with a 400 or, for an
    unknown field under server-side apply, a 500)."""
    found: list[Problem] = []
    for key in toleration:
        if key not in TOLERATION_FIELDS:
            found.append((f"{path}.{key}", f"is not a field of a toleration; valid: {', '.join(TOLERATION_FIELDS)}"))
    for key in ("key", "operator", "value", "effect"):
        if key in toleration and not isinstance(toleration[key], str):
            found.append((f"{path}.{key}", f"must be a string, got {toleration[key]!r}"))
    if found:
        return found
    key, value = toleration.get("key", ""), toleration.get("value", "")
    operator, effect = toleration.get("operator", "Equal") or "Equal", toleration.get("effect", "")
    if key and (why := qualified_name_problem(key)):
        found.append((f"{path}.key", f"{key!r} {why}"))
    if operator not in TOLERATION_OPERATORS:
        found.append((f"{path}.operator", f"{operator!r} must be Exists or Equal"))
    elif not key and operator != "Exists":
        found.append((f"{path}.operator", "an empty key tolerates every taint only with operator: Exists"))
    if operator == "Exists" and value:
        found.append((f"{path}.value", "must be empty with operator: Exists"))
    elif value and (why := label_value_problem(value)):
        found.append((f"{path}.value", f"{value!r} {why}"))
    if effect and effect not in TAINT_EFFECTS:
        found.append((f"{path}.effect", f"{effect!r} must be empty or one of {', '.join(TAINT_EFFECTS)}"))
    if "tolerationSeconds" in toleration:
        seconds = toleration["tolerationSeconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            found.append((f"{path}.tolerationSeconds", f"must be an integer, got {seconds!r}"))
        elif effect != "NoExecute":
            found.append((f"{path}.tolerationSeconds", "applies only with effect: NoExecute; set it or remove this"))
    return found


def scheduling_problems(
    *, node_selector: Mapping[str, str], tolerations: Iterable[Mapping[str, Any]], priority_class: str | None,
    queue: str | None,
) -> list[Problem]:  # fmt: skip
    base = "spec.scheduling"
    found: list[Problem] = []
    for key, value in node_selector.items():
        if why := qualified_name_problem(key):
            found.append((f"{base}.nodeSelector", f"key {key!r} {why}"))
        if why := label_value_problem(value):
            found.append((f"{base}.nodeSelector.{key}", f"{value!r} {why}"))
    for i, toleration in enumerate(tolerations):
        found += toleration_problems(f"{base}.tolerations[{i}]", toleration)
    if priority_class and (why := subdomain_problem(priority_class)):
        found.append((f"{base}.priorityClassName", f"{priority_class!r} {why} (the name of a PriorityClass)"))
    if queue and (why := label_value_problem(queue)):
        # Kueue reads the queue from the pods' kueue.x-k8s.io/queue-name label.
        found.append((f"{base}.queueName", f"{queue!r} {why} (it becomes the pods' kueue.x-k8s.io/queue-name label)"))
    return found


# ---------------------------------------------------------------------------
# What the servers execute


def model_path_problems(path: str, *, volume: bool) -> list[Problem]:
    """The model path is an argument of ``vllm serve``/``--model-path``: one starting with ``-``
    would be read as a flag (``--trust-remote-code``); inside a volume it must stay inside."""
    field = "spec.model.path"
    if path.startswith("-"):
        return [(field, f"{path!r} starts with '-', which the servers read as a flag; give a Hugging Face id "
                        "(Qwen/Qwen3-8B) or a path inside spec.model.volume")]  # fmt: skip
    if volume:
        if path.startswith("/"):
            return [(field, f"{path!r} is absolute; with spec.model.volume it is a path inside the volume, written "
                            f"relative to its root ({path.lstrip('/') or 'qwen3-8b'!r})")]  # fmt: skip
        if ".." in path.split("/") or posixpath.normpath(path).startswith(".."):
            return [(field, f"{path!r} has '..' segments and could leave the volume; write the path from the "
                            "volume's root without '..'")]  # fmt: skip
    elif ".." in path.split("/"):
        return [(field, f"{path!r} has '..' segments; give a Hugging Face id or a path without '..'")]
    return []


def server_flag_problems(path: str, backend: str, args: list[str], *, allowed: frozenset[str]) -> list[Problem]:
    """Under allow-lists, every flag in a server's ``serverArgs`` must be one that loads no code
    (:data:`~rljob_operator.servers.SAFE_SERVER_FLAGS` of ``backend``) or one the cluster admin allowed (``--allow-server-flag``). Flags are
    matched whole, after vLLM's own normalisation (``_`` -> ``-``, ``--flag=value``), so a prefix
    (``--trust-remote``), the dotted JSON form (``--kv-transfer-config.x``) or ``--config FILE``
    never slips through. Values (tokens that do not start with ``-``) are data."""
    safe = SAFE_SERVER_FLAGS.get(backend, frozenset())
    found: list[Problem] = []
    for i, token in enumerate(args):
        if not token.startswith("-") or _is_number(token):
            continue
        name = token.split("=", 1)[0]
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if name in safe or name in allowed:
            continue
        found.append(
            (
                f"{path}[{i}]",
                f"{name!r} is not allowed by this operator: with allow-lists set, servers take only flags that "
                "load no code or files (docs/rljob-reference.md lists them); remove it, or ask the cluster admin "
                "to add it to the chart's admission.allowedServerFlags",
            )
        )
    return found


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def image_allowed(image: str, prefixes: Iterable[str]) -> bool:
    """``image`` starts with one of ``prefixes`` at a path-segment boundary: a prefix ending in
    ``/``, ``:`` or ``@`` is matched as written; any other must be followed by ``/``, ``:``,
    ``@`` or the end (``ghcr.io/treetrain`` never admits ``ghcr.io/treetrainevil/x``)."""
    for prefix in prefixes:
        if not prefix or not image.startswith(prefix):
            continue
        if prefix[-1] in "/:@" or len(image) == len(prefix) or image[len(prefix)] in "/:@":
            return True
    return False


# ---------------------------------------------------------------------------
# Child names and the labels their controllers add


def child_problems(
    objects: list[dict[str, Any]], *, blame: Mapping[str, tuple[str, str]], worst_job_names: Mapping[str, str]
) -> list[Problem]:
    """Every name and label value the rendered children and their pods will carry. ``blame`` maps
    a child's name to (field path, how to fix) of the user's fields that make it;
    ``worst_job_names`` maps a trainer Job's name to its name at the last restart allowed."""
    found: list[Problem] = []
    for obj in objects:
        kind, meta = obj["kind"], obj["metadata"]
        name = meta["name"]
        path, fix = blame.get(name, ("metadata.name", "shorten metadata.name"))
        values = [("its name", name, LABEL_MAX if kind == "Service" else SUBDOMAIN_MAX)]
        values += [
            (f"the label {k}", v, LABEL_MAX) for k, v in {**meta.get("labels", {}), **_template_labels(obj)}.items()
        ]
        if kind == "StatefulSet":
            last = obj["spec"]["replicas"] - 1
            values.append(("the pods' controller-revision-hash label", f"{name}-{'x' * REVISION_HASH_MAX}", LABEL_MAX))
            values.append(("the last pod's name (its hostname)", f"{name}-{last}", LABEL_MAX))
        elif kind == "Job":
            last = obj["spec"]["completions"] - 1
            for job in dict.fromkeys((name, worst_job_names.get(name, name))):
                values.append(("the pods' batch.kubernetes.io/job-name label", job, LABEL_MAX))
                values.append(("the last pod's hostname", f"{job}-{last}", LABEL_MAX))
        for what, value, limit in values:
            if len(value) > limit:
                found.append((path, f"{kind} {name!r}: {what} would be {value!r}, {len(value)} characters (the API "
                                    f"allows {limit}); {fix} by {len(value) - limit}"))  # fmt: skip
        if kind == "Service" and not _DNS_1035.fullmatch(name):
            found.append((path, f"Service {name!r}: a Service name must start with a letter; start metadata.name "
                                "with a letter"))  # fmt: skip
        if kind == "ConfigMap":
            size = sum(len(k.encode()) + len(str(v).encode()) for k, v in obj.get("data", {}).items())
            if size > CONFIG_MAP_MAX_BYTES:
                found.append(("spec.trainerConfig", f"the trainer config is {size} bytes; a ConfigMap holds at most "
                                                    f"{CONFIG_MAP_MAX_BYTES} (1 MiB): make taskArgs smaller"))  # fmt: skip
    return list(dict.fromkeys(found))


def _template_labels(obj: dict[str, Any]) -> dict[str, str]:
    template = obj.get("spec", {}).get("template")
    labels: dict[str, str] = template.get("metadata", {}).get("labels", {}) if isinstance(template, dict) else {}
    return labels
