"""The trainer config reference, generated from the schema (docs/trainer.md embeds it; a test
keeps the doc in step, ``python docs/generate.py`` rewrites it)."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel

from treetrain.config.schema import TrainConfig


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(annotation) if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in typing.get_args(annotation) else "")
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(annotation, str(annotation))


def _default(info: Any) -> str:
    if info.is_required():
        return "**required**"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`"


def _section(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        if typing.get_origin(candidate) is list:
            inner = typing.get_args(candidate)[0]
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def table(model: type[BaseModel] = TrainConfig) -> str:
    """Every key of the trainer config: path, type, default, meaning."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, info in cls.model_fields.items():
            key = info.alias or name
            path = f"{prefix}.{key}" if prefix else key
            sub = _section(info.annotation)
            meaning = info.description or ((sub.__doc__ or "").split("\n")[0] if sub else "")
            listed = typing.get_origin(info.annotation) is list and sub is not None
            rows.append(f"| `{path}` | {_type_name(info.annotation)} | {_default(info)} | {meaning} |")
            if sub is not None:
                walk(sub, path + ("[]" if listed else ""))

    walk(model, "")
    return "\n".join(rows) + "\n"
