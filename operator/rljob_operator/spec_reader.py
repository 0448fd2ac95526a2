"""The one reader of an RLJob manifest as written: its envelope (apiVersion, kind, name), its
spec through the pydantic model and, when that model refuses the spec, what can still be read
from the raw mapping (the backend-bearing fields, the trainer config sections), so one run
lists every problem. Nothing else in the operator reads the raw spec."""

from __future__ import annotations

import difflib
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from rljob_operator.errors import FieldError, PlanError
from rljob_operator.models import GROUP, KIND, VERSION, RLJobSpec
from rljob_operator.names import MAX_NAME_LENGTH
from treetrain.config.load import field_name, value_problem
from treetrain.config.trainer_settings import TrainerSettings

# Deeper than this is refused before any model reads it: pydantic gives up past about 250 levels
# (a traceback), Python's JSON reader past about 990 (kopf's watch died); real manifests nest < 15.
MAX_DEPTH = 64


@dataclass(frozen=True)
class Engines:
    """The backend-bearing fields of a spec, read from the model or, when the schema
    failed, as far as possible from the raw mapping."""

    gpus_per_node: int
    rollouts: list[tuple[str, str, str]]  # (component, field path, backend)
    actor: str | None
    aux: list[tuple[str, str, bool]]  # (role, backend or "", colocated)


@dataclass(frozen=True)
class Reading:
    """What one manifest says, and the problems found reading it."""

    name: str
    namespace: str
    uid: str | None
    spec: RLJobSpec | None  # None: the schema refused the spec (see errors)
    engines: Engines
    written_sections: dict[str, Any]  # the trainer config sections spelled like the config itself
    errors: list[FieldError] = field(default_factory=list)


def read(manifest: Any) -> Reading:
    """Read ``manifest``; a PlanError at once for what cannot be read at all (not a mapping, too deep)."""
    if not isinstance(manifest, dict):
        raise PlanError([FieldError("(document)", "an RLJob manifest must be a mapping")])
    _check_depth(manifest)
    errors: list[FieldError] = []
    if manifest.get("apiVersion") != f"{GROUP}/{VERSION}":
        errors.append(FieldError("apiVersion", f"must be {GROUP}/{VERSION}, got {manifest.get('apiVersion')!r}"))
    if manifest.get("kind") != KIND:
        errors.append(FieldError("kind", f"must be {KIND}, got {manifest.get('kind')!r}"))
    metadata = manifest.get("metadata") or {}
    name = str(metadata.get("name") or "")
    errors += _check_name(name)
    raw = manifest.get("spec")
    spec: RLJobSpec | None = None
    try:
        spec = RLJobSpec.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        errors += [_pydantic_error(e) for e in exc.errors()]
    return Reading(
        name=name,
        namespace=str(metadata.get("namespace") or "default"),
        uid=metadata.get("uid") or None,
        spec=spec,
        engines=_engines(spec, raw),
        written_sections=_written_sections(raw),
        errors=errors,
    )


def _check_depth(manifest: dict[str, Any]) -> None:
    """A PlanError naming where ``manifest`` nests more than :data:`MAX_DEPTH` levels; iterative."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(manifest, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            where = ".".join(path[:4]) + (".…" if len(path) > 4 else "")
            raise PlanError([FieldError(where, f"nested more than {MAX_DEPTH} levels deep; an RLJob may nest at "
                                               f"most {MAX_DEPTH}: flatten it")])  # fmt: skip
        if isinstance(node, dict):
            stack.extend((v, (*path, str(k))) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, f"[{i}]")) for i, v in enumerate(node))


def _check_name(name: str) -> list[FieldError]:
    if not name:
        return [FieldError("metadata.name", "is required")]
    if len(name) > MAX_NAME_LENGTH or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        return [
            FieldError(
                "metadata.name",
                f"{name!r} must be a DNS label of at most {MAX_NAME_LENGTH} characters "
                "(lower-case letters, digits, '-'), so that child names stay valid",
            )
        ]
    return []


def _pydantic_error(error: Any) -> FieldError:
    path = ".".join(field_name(p) for p in ("spec", *error["loc"]))
    if error["type"] == "missing":
        return FieldError(path, "is required")
    if error["type"] == "extra_forbidden":
        if len(error["loc"]) >= 3 and error["loc"][-3] == "resources":
            return FieldError(path, "requests and limits take cpu and memory only; the operator sets the GPUs "
                                    "from the backend (as spec.gpuResourceName)")  # fmt: skip
        hint = _spelling_hint(tuple(error["loc"]))
        return FieldError(path, f"is not a field of RLJob (check the spelling; fields are camelCase){hint}")
    return FieldError(path, value_problem(error))


def _spelling_hint(loc: tuple[Any, ...]) -> str:
    """'; did you mean X?' for a key close to a field beside it, or named like a field elsewhere
    in the spec (``actor.maxTokensPerMicrobatch``: ``spec.actor.treeTraining.maxTokensPerMicrobatch``)."""
    key, where = str(loc[-1]), loc[:-1]
    here: type[BaseModel] | None = RLJobSpec
    for part in where:
        if here is None:
            return ""
        if not isinstance(part, int):
            info = next((f for n, f in here.model_fields.items() if part in (n, f.alias)), None)
            here = _model(info.annotation) if info is not None else None
    siblings = [f.alias or n for n, f in here.model_fields.items()] if here is not None else []
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.75)
    if close:
        return f"; did you mean {'.'.join(field_name(p) for p in ('spec', *where, close[0]))}?"
    prefix = ".".join(field_name(p) for p in ("spec", *where))
    elsewhere = [p for p in field_paths(RLJobSpec, "spec") if p.rsplit(".", 1)[-1].lower() == key.lower()]
    elsewhere.sort(key=lambda p: (not p.startswith(prefix + "."), len(p)))
    return f"; did you mean {elsewhere[0]}?" if elsewhere else ""


def _model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (Optional, Annotated and list unwrapped), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model(arg)) is not None:
            return found
    return None


@functools.cache
def field_paths(model: type[BaseModel], prefix: str = "") -> tuple[str, ...]:
    """Every field path under ``model`` (camelCase) outside lists (a hint names one field, not
    one per item)."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}" if prefix else info.alias or name
        out.append(path)
        sub = _model(info.annotation)
        if sub is not None and typing.get_origin(info.annotation) is not list:
            out += field_paths(sub, path)
    return tuple(out)


def _written_sections(raw: Any) -> dict[str, Any]:
    """The trainer config sections an RLJob spec spells like the config itself."""
    raw = raw if isinstance(raw, dict) else {}
    found = {
        "actor": raw.get("actor"),
        "critic": raw.get("critic"),
        "ref": raw.get("ref"),
        "trainer": raw.get("trainerConfig"),
    }
    if isinstance(found["actor"], dict):  # resources are the RLJob's, not the trainer's
        found["actor"] = {k: v for k, v in found["actor"].items() if k != "resources"}
    # model.path is a placeholder (a broken schema may hide the real one); its problems are dropped.
    return {"model": {"path": "unchecked"}, **{k: v for k, v in found.items() if isinstance(v, dict)}}


def _engines(spec: RLJobSpec | None, raw: Any) -> Engines:
    if spec is not None:
        rollouts = [("rollout", "spec.rollout.backend", spec.rollout.backend)]
        rollouts += [
            (f"rollout-{e.name}", f"spec.additionalRollouts[{i}].backend", e.backend)
            for i, e in enumerate(spec.additional_rollouts)
        ]
        aux = [(role, a.backend, a.colocated) for role in ("critic", "ref") if (a := getattr(spec, role)) is not None]
        return Engines(spec.gpus_per_node, rollouts, spec.actor.backend, aux)
    raw = raw if isinstance(raw, dict) else {}

    def backend(node: Any) -> str | None:
        value = node.get("backend") if isinstance(node, dict) else None
        return value if isinstance(value, str) and value else None

    gpus = raw.get("gpusPerNode", 8)
    rollouts = [("rollout", "spec.rollout.backend", b)] if (b := backend(raw.get("rollout"))) else []
    extra = raw.get("additionalRollouts")
    for i, node in enumerate(extra if isinstance(extra, list) else []):
        if (b := backend(node)) and isinstance(node.get("name"), str):
            rollouts.append((f"rollout-{node['name']}", f"spec.additionalRollouts[{i}].backend", b))
    aux = []
    for role in ("critic", "ref"):
        node = raw.get(role)
        if isinstance(node, dict):
            aux.append((role, backend(node) or "", node.get("colocated", True) is not False))
    return Engines(
        gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1 else 8,
        rollouts,
        backend(raw.get("actor")),
        aux,
    )


# -- field paths -------------------------------------------------------------------------------

_PATH_PART = re.compile(r"\[[^\]]*\]|[^.\[\]]+")


def names_a_field(path: str) -> bool:
    """Whether ``path`` (``spec.actor.treeTraining.maxTokensPerMicrobatch``,
    ``spec.additionalRollouts[0].name``, ``metadata.name``) is a field of an RLJob: the models
    walked by their camelCase names, ``spec.trainerConfig`` by the trainer's ``trainer:``
    schema; under a free-form mapping (``model.config``, ``taskArgs``, ``nodeSelector``) any key."""
    head, *rest = _PATH_PART.findall(path) or [""]
    if head in ("apiVersion", "kind"):
        return not rest
    if head == "metadata":
        return len(rest) <= 1
    return head == "spec" and _walk(RLJobSpec, rest)


def _walk(annotation: Any, parts: list[str]) -> bool:
    if not parts:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _walk(typing.get_args(annotation)[0], parts)
    if origin in (typing.Union, types.UnionType):
        return any(_walk(a, parts) for a in typing.get_args(annotation) if a is not type(None))
    head, rest = parts[0], parts[1:]
    if origin is list:
        return head.startswith("[") and _walk(typing.get_args(annotation)[0], rest)
    if origin is dict or annotation is dict:
        return not head.startswith("[")
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, info in annotation.model_fields.items():
            if head == (info.alias or name):
                # spec.trainerConfig is free-form in the model (the trainer's rules check it) but
                # has the trainer's schema.
                inner = TrainerSettings if annotation is RLJobSpec and name == "trainer_config" else info.annotation
                return _walk(inner, rest)
    return False
