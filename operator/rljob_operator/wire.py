"""Decoding what the API server sends, so that no object it accepts can stop the operator.

The API server stores RLJobs nested thousands of levels deep (``spec.trainerConfig`` keeps
unknown fields, and a structural schema cannot bound the depth below such a field). Python's
``json.loads`` raises ``RecursionError`` past about 990 levels, and much of what runs after it
(copying, pydantic, ``json.dumps``) fails far earlier. :func:`loads` therefore never returns
anything nested deeper than :data:`MAX_WIRE_DEPTH`: an object deeper than that has the part
below the bound replaced by :data:`TOO_DEEP`, so its name and namespace still arrive, the
operator reconciles it, and ``plan`` (which allows less depth) refuses it with a condition.

:func:`tolerate_deep_objects_in_kopf` makes kopf's watch and list decode through
:func:`loads` too: without it one such RLJob ends kopf's RLJob watch, and the operator exits
on every restart.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import logging
import re
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rljob_operator")

# More than spec_reader.MAX_DEPTH (so a cut object is always refused as too deep), and far below
# where copying or validating a decoded object would run out of recursion.
MAX_WIRE_DEPTH = 100
TOO_DEEP = f"(nested more than {MAX_WIRE_DEPTH} levels deep: cut off by the operator)"

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = json.scanner.NUMBER_RE
_BRACKET_OR_QUOTE = re.compile(r'["{}\[\]]')
_LITERALS = {"true": True, "false": False, "null": None}
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def depth(value: Any) -> int:
    """How many containers deep ``value`` nests (a scalar is 0, ``{"a": 1}`` is 1); iterative."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def loads(data: str | bytes) -> Any:
    """``json.loads``, except that nothing nested deeper than :data:`MAX_WIRE_DEPTH` comes back
    (the deeper part of such an object is :data:`TOO_DEEP`) and deep input never raises."""
    text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    else:
        if depth(value) <= MAX_WIRE_DEPTH:
            return value
    value = capped(text, MAX_WIRE_DEPTH)
    log.warning("the API server sent %s nested more than %d levels deep; the deeper part is cut off "
                "(such an RLJob is refused as invalid)", _names(value), MAX_WIRE_DEPTH)  # fmt: skip
    return value


def capped(text: str, cap: int) -> Any:
    """Parse JSON ``text`` without recursion; containers below depth ``cap`` become :data:`TOO_DEEP`."""
    stack: list[tuple[dict[str, Any] | list[Any], list[str]]] = []  # (container, [key awaiting its value])
    i = _ws(text, 0)
    while True:
        # A value starts at i.
        ch = _at(text, i)
        value: Any
        if ch in "{[":
            if len(stack) >= cap:
                value, i = TOO_DEEP, _skip_container(text, i + 1)
            else:
                close = "}" if ch == "{" else "]"
                i = _ws(text, i + 1)
                if _at(text, i) == close:
                    value, i = ({} if ch == "{" else []), i + 1
                else:
                    container: dict[str, Any] | list[Any] = {} if ch == "{" else []
                    pending: list[str] = []
                    if ch == "{":
                        i = _key(text, i, pending)
                    stack.append((container, pending))
                    continue
        elif ch == '"':
            value, i = _scanstring(text, i + 1)
        else:
            value, i = _scalar(text, i)
        # Put the value in its container; close every container that ends here.
        while True:
            if not stack:
                if _ws(text, i) != len(text):
                    raise ValueError(f"extra data at character {i}")
                return value
            container, pending = stack[-1]
            if isinstance(container, dict):
                container[pending.pop()] = value
            else:
                container.append(value)
            i = _ws(text, i)
            ch = _at(text, i)
            if ch == ",":
                i = _ws(text, i + 1)
                if isinstance(container, dict):
                    i = _key(text, i, pending)
                break
            if ch != ("}" if isinstance(container, dict) else "]"):
                raise ValueError(f"unexpected {ch!r} at character {i}")
            stack.pop()
            value, i = container, i + 1


def _at(text: str, i: int) -> str:
    if i >= len(text):
        raise ValueError("unexpected end of JSON")
    return text[i]


def _ws(text: str, i: int) -> int:
    match = _WS.match(text, i)
    return match.end() if match else i


def _key(text: str, i: int, pending: list[str]) -> int:
    """Read ``"key":`` at ``i`` into ``pending``; the index of the value after it."""
    if _at(text, i) != '"':
        raise ValueError(f"expected a key at character {i}")
    key, i = _scanstring(text, i + 1)
    i = _ws(text, i)
    if _at(text, i) != ":":
        raise ValueError(f"expected ':' at character {i}")
    pending.append(key)
    return _ws(text, i + 1)


def _scalar(text: str, i: int) -> tuple[Any, int]:
    for word, value in _LITERALS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    match = _NUMBER.match(text, i)
    if not match:
        raise ValueError(f"unexpected {text[i : i + 1]!r} at character {i}")
    integer, fraction, exponent = match.groups()
    number = float(integer + (fraction or "") + (exponent or "")) if fraction or exponent else int(integer)
    return number, match.end()


def _skip_container(text: str, i: int) -> int:
    """The index after the container whose opening bracket is just before ``i``."""
    level = 1
    while level:
        match = _BRACKET_OR_QUOTE.search(text, i)
        if match is None:
            raise ValueError("unexpected end of JSON")
        ch, i = match.group(), match.end()
        if ch == '"':
            _, i = _scanstring(text, i)
        else:
            level += 1 if ch in "{[" else -1
    return i


def _names(value: Any) -> str:
    """The objects in a decoded response (one object, a list, or a watch event), by namespace/name."""
    if isinstance(value, dict) and isinstance(value.get("object"), dict):
        value = value["object"]
    items = value.get("items") if isinstance(value, dict) and "items" in value else [value]
    names = []
    for item in items if isinstance(items, list) else []:
        meta = item.get("metadata") if isinstance(item, dict) else None
        if isinstance(meta, dict) and _was_cut(item):
            names.append(f"{item.get('kind', 'object')} {meta.get('namespace', '')}/{meta.get('name', '?')}")
    return ", ".join(names) or "an object"


def _was_cut(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        if node is TOO_DEEP:
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


class _KopfJson:
    """What kopf's API module uses as ``json``: :func:`loads` for each watch event."""

    loads = staticmethod(loads)
    dumps = staticmethod(json.dumps)


def tolerate_deep_objects_in_kopf() -> None:
    """Make kopf decode watch events and list responses with :func:`loads`.

    kopf decodes each watch line with its API module's ``json.loads`` and each list with
    aiohttp's ``ClientResponse.json()``; both are pointed at :func:`loads` (the operator's
    process has no other aiohttp client). tests/unit/test_operator_wire.py checks that these
    places still exist in the installed kopf and aiohttp.
    """
    import aiohttp
    from kopf._cogs.clients import api

    api.json = _KopfJson  # type: ignore[attr-defined,assignment]
    defaults = aiohttp.ClientResponse.json.__kwdefaults__
    assert defaults is not None and "loads" in defaults, "aiohttp's ClientResponse.json() lost its loads="
    defaults["loads"] = loads
