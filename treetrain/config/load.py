"""Reading a trainer config: YAML in, a checked :class:`TrainConfig` out, every problem at once.

The environment is read here and nowhere else: the documented ``TREETRAIN_*`` overrides are
written into the raw mapping before validation (so an override is checked like the key it
replaces, and its problems name the variable), and what is not config (the restart count,
whether we run in a pod) comes back beside the config as :class:`Launch`.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from treetrain.config.check import problems
from treetrain.config.defaults import embedded_default
from treetrain.config.rules import Problem, Sections
from treetrain.config.schema import TrainConfig

# Variable -> the config key it overrides (documented in docs/contracts.md).
ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    "TREETRAIN_ATTENTION": ("actor", "treeTraining", "attention"),
    "TREETRAIN_BLOCK_SIZE": ("actor", "treeTraining", "blockSize"),
    "TREETRAIN_CHECKPOINT_DIR": ("checkpoint", "dir"),
    "TREETRAIN_ROLLOUT_ENDPOINTS": ("rollout", "servers"),
}


class ConfigError(ValueError):
    """Every problem of a trainer config, one per line, each with its field path."""

    def __init__(self, found: list[Problem]) -> None:
        self.problems = found
        lines = "\n".join(f"  - {path}: {message}" if path else f"  - {message}" for path, message in found)
        super().__init__(f"invalid trainer config ({len(found)} problem{'s' if len(found) != 1 else ''}):\n{lines}")


@dataclass(frozen=True, slots=True)
class Launch:
    """What the environment says about this run that is not config."""

    restart: int = 0  # TREETRAIN_RESTART: the trainer gang's restart count (the operator sets it)
    in_pod: bool = False  # inside Kubernetes: listeners bind every interface


def validate(
    raw: Any, *, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> TrainConfig:
    """Check ``raw`` (a mapping as read from YAML) after the environment and ``overrides``
    (``{"trainer.steps": 3}``, from command-line flags) are applied; raises ConfigError."""
    config, _ = validate_with_launch(raw, env=env or {}, overrides=overrides)
    return config


def validate_with_launch(
    raw: Any, *, env: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> tuple[TrainConfig, Launch]:
    found: list[Problem] = []
    if not isinstance(raw, dict):
        raise ConfigError([("", f"the config must be a mapping (model:, actor:, trainer:, ...), got {_kind(raw)}")])
    raw = copy.deepcopy(raw)
    sources: dict[str, str] = {}  # field path -> the variable or flag that set it
    launch = _apply_env(raw, env, sources, found)
    for dotted, value in (overrides or {}).items():
        _set(raw, tuple(dotted.split(".")), value)
    try:
        config = TrainConfig.model_validate(raw)
    except ValidationError as err:
        found += [_schema_problem(e) for e in err.errors()]
        config = None
    found += problems(_sections(raw))
    if found:
        found = [(p, f"{m} (from {sources[p]})" if p in sources else m) for p, m in _unique(found)]
        raise ConfigError(found)
    assert config is not None
    return config, launch


def load(
    path: str | Path, *, env: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> tuple[TrainConfig, Launch]:
    """Read and check a YAML file; raises ConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError([("", f"{p}: cannot read the config: {getattr(err, 'strerror', None) or err}")]) from None
    return validate_with_launch(read_yaml(text, str(p)), env=env, overrides=overrides)


def load_default(*, env: Mapping[str, str], overrides: Mapping[str, Any] | None = None) -> tuple[TrainConfig, Launch]:
    """The embedded default, with the same environment and overrides as a file."""
    return validate_with_launch(embedded_default(), env=env, overrides=overrides)


# Bounds on hostile YAML: a config or manifest is far smaller. Aliases share nodes when read,
# so a few lines can stand for billions of values once walked ("billion laughs").
MAX_YAML_BYTES = 2 << 20
MAX_YAML_VALUES = 200_000


def read_yaml(text: str, where: str) -> Any:
    """One YAML document, bounded in size, depth and expanded values; ConfigError otherwise."""
    (document,) = read_yaml_documents(text, where, at_most=1) or [None]
    return document


def read_yaml_documents(text: str, where: str, *, at_most: int | None = None) -> list[Any]:
    """Every non-empty document of ``text`` (YAML 1.2 floats), each one checked for size, depth
    and alias blow-up; one-line :class:`ConfigError` for anything else."""
    import yaml

    if len(text) > MAX_YAML_BYTES:
        raise ConfigError([("", f"{where}: {len(text):,} bytes; a config or manifest is at most {MAX_YAML_BYTES:,}")])
    try:
        documents = [d for d in yaml.load_all(text, Loader=_loader()) if d is not None]  # a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError([("", f"{where}: not valid YAML: {' '.join(str(err).split())}")]) from None
    except RecursionError:
        raise ConfigError([("", f"{where}: YAML nested too deeply")]) from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise ConfigError([("", f"{where}: {str(err).split(':')[0]}")]) from None
    if at_most is not None and len(documents) > at_most:
        raise ConfigError([("", f"{where}: {len(documents)} YAML documents; expected {at_most}")])
    for document in documents:
        if _values_beyond(document, MAX_YAML_VALUES):
            raise ConfigError(
                [("", f"{where}: expands to more than {MAX_YAML_VALUES:,} values (YAML aliases?); refused")]
            )
    return documents


def _values_beyond(document: Any, limit: int) -> bool:
    """Whether walking ``document`` (aliases expanded, as any reader would) meets more than
    ``limit`` values; stops as soon as it does, so a blow-up costs ``limit`` steps."""
    stack, seen = [document], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def dump_yaml(config: TrainConfig) -> str:
    """The config as YAML (what the operator writes into the ConfigMap): only what was set."""
    import yaml

    data = config.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return yaml.dump(data, Dumper=_dumper(), sort_keys=False)


# YAML 1.2 floats: ``1e-6`` is a number (PyYAML's YAML 1.1 reads it as a string).
_FLOAT = re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d[\d_]*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*(?:[eE][-+]?\d+)?$")


@functools.cache
def _loader() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        """Reads YAML 1.2 floats as numbers."""

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Loader


@functools.cache
def _dumper() -> Any:
    import yaml

    class Dumper(yaml.SafeDumper):
        """Quotes a string the loader would read as a float (``"0E0"``), so a dump reads back unchanged."""

    Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Dumper


# -- the environment ------------------------------------------------------------------------


def _apply_env(raw: dict[str, Any], env: Mapping[str, str], sources: dict[str, str], found: list[Problem]) -> Launch:
    for var, path in ENV_OVERRIDES.items():
        value: Any = env.get(var, "").strip()
        if not value:
            continue
        if var == "TREETRAIN_BLOCK_SIZE":
            if not value.isdigit():
                found.append((var, f"must be a positive integer, got {value!r}"))
                continue
            value = int(value)
        elif var == "TREETRAIN_ROLLOUT_ENDPOINTS":
            value = [{"url": url.strip()} for url in value.split(",") if url.strip()]
        _set(raw, path, value)
        sources[".".join(path)] = var
    role = env.get("TREETRAIN_ROLE", "actor") or "actor"
    if role != "actor":
        found.append(
            (
                "TREETRAIN_ROLE",
                f"{role}: separate {role} pods are not supported yet; colocate the {role} with the actor",
            )
        )
    restart_text = env.get("TREETRAIN_RESTART", "0") or "0"
    if not restart_text.isdigit():
        found.append(("TREETRAIN_RESTART", f"must be a non-negative integer, got {restart_text!r}"))
        restart_text = "0"
    return Launch(restart=int(restart_text), in_pod=bool(env.get("KUBERNETES_SERVICE_HOST")))


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = raw
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[path[-1]] = value


# -- schema problems, with a hint for a misplaced or misspelt key -----------------------------


def _sections(raw: dict[str, Any]) -> Sections:
    """Each top-level section validated on its own, and a broken one again without its broken
    keys, so cross-section rules still run on whatever is sound."""
    built: dict[str, Any] = {}
    broken: set[str] = set()
    for name, info in TrainConfig.model_fields.items():
        key = info.alias or name
        value = raw.get(key, raw.get(name))
        cls = _model_class(info.annotation)
        if value is None or cls is None:
            built[name] = info.get_default(call_default_factory=True) if not info.is_required() else None
            continue
        try:
            built[name] = cls.model_validate(value)
            continue
        except ValidationError as err:
            bad = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
        broken |= {f"{key}.{k}" for k in bad} if bad else {key}
        rest = {k: v for k, v in value.items() if k not in bad} if isinstance(value, dict) and bad else None
        try:
            built[name] = cls.model_validate(rest) if rest is not None else None
        except ValidationError:
            built[name] = None
        if built[name] is None:
            broken.add(key)
            if not info.is_required() and info.default is not None:
                built[name] = info.get_default(call_default_factory=True)
    return Sections(**built, present=frozenset(raw), broken=frozenset(broken))


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_class(arg)
            if found is not None:
                return found
    if typing.get_origin(annotation) is list:
        return _model_class(typing.get_args(annotation)[0])
    return None


def field_name(part: Any) -> str:
    """A key as it reads in a one-line message: quoted when empty or not printable."""
    text = str(part)
    return text if text and text.isprintable() and "." not in text else json.dumps(text)


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{field_name(part)}" if out else field_name(part))
    return out


def _schema_problem(error: Any) -> Problem:
    loc = tuple(error["loc"])
    path = _path(loc)
    kind = error["type"]
    if kind == "missing":
        return path, "required"
    if kind == "extra_forbidden":
        return path, "unknown key" + _hint(loc)
    return path, value_problem(error)


def value_problem(error: Any) -> str:
    """A pydantic error about a value, in the words every config problem uses (the operator
    words the RLJob's own fields the same way)."""
    value = error.get("input")
    message = str(error["msg"])
    if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping, got {_kind(value)}"
    return f"{message[0].lower()}{message[1:]}, got {value!r}"


def _hint(loc: tuple[Any, ...]) -> str:
    """'; did you mean X?' for a key that is close to a sibling, or that names a field
    elsewhere in the schema; else the valid keys here."""
    key = str(loc[-1])
    here = _class_at(loc[:-1])
    siblings = _aliases(here) if here is not None else []
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.75)
    if close:
        return f"; did you mean {_path((*loc[:-1], close[0]))}?"
    elsewhere = [p for p in _ALL_PATHS if p.rsplit(".", 1)[-1].lower() == key.lower()]
    if elsewhere:
        prefix = _path(loc[:-1])
        elsewhere.sort(key=lambda p: (not p.startswith(prefix), len(p)))
        return f"; did you mean {elsewhere[0]}?"
    return f"; valid keys: {', '.join(siblings)}" if siblings else ""


def _class_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    cls: type[BaseModel] | None = TrainConfig
    for part in loc:
        if cls is None:
            return None
        if isinstance(part, int):
            continue
        info = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        cls = _model_class(info.annotation) if info is not None else None
    return cls


def _aliases(cls: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in cls.model_fields.items()]


def _all_paths(cls: type[BaseModel], prefix: str) -> list[str]:
    out = []
    for name, info in cls.model_fields.items():
        path = f"{prefix}.{info.alias or name}" if prefix else (info.alias or name)
        out.append(path)
        sub = _model_class(info.annotation)
        if sub is not None and typing.get_origin(info.annotation) is not list:
            out += _all_paths(sub, path)
    return out


_ALL_PATHS = _all_paths(TrainConfig, "")


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )


def _unique(found: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(found))
