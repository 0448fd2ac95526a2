"""Parse backend strings (``sglang:d2t4``, ``fsdp:d4t2``, ``megatron:(attn:...|ffn:...)``).

``parse`` turns one string into an ``Allocation`` or raises one ``AllocationError``
that carries the column and a fix. ``migrate`` turns AReaL's legacy multi-component
strings into the per-engine ``backend`` fields an RLJob takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

from lark import Lark, Token, Tree
from lark.exceptions import LarkError, UnexpectedInput

from treetrain.alloc.errors import (
    AllocationError,
    AllocationSyntaxError,
    AllocationValidationError,
    LegacySpecError,
    MissingBackendError,
    shorten,
)
from treetrain.alloc.model import (
    ATTN_LETTERS,
    FFN_LETTERS,
    FIELD_NAME,
    LETTER_FIELD,
    MAX_SIZE,
    Allocation,
    ParallelDims,
    hybrid_fix,
    server_letters,
)
from treetrain.alloc.registry import default_training, either, hybrid_names, names, running, spec_of
from treetrain.alloc.syntax import server, syntax_error

ALL_LETTERS = "".join(LETTER_FIELD)  # what any training backend's string may hold before Allocation decides


@functools.cache
def _lark() -> Lark:
    grammar = resources.files("treetrain.alloc").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True)


def parse(spec: str) -> Allocation:
    """Parse one engine's backend string.

    >>> parse("sglang:d2t4").world_size
    8
    """
    engines = _parse_engines(spec)
    if len(engines) == 1 and engines[0].label is None and not engines[0].colocated_with:
        return engines[0].allocation
    raise _legacy_error(spec, engines)


def migrate(legacy: str) -> list[tuple[str, str]]:
    """The ``(engine, backend string)`` fields that replace a legacy allocation string.

    >>> migrate("sglang:d4+fsdp:d4")
    [('rollout', 'sglang:d4'), ('actor', 'fsdp:d4')]
    """
    engines = _parse_engines(legacy)
    return [(role, str(engine.allocation)) for role, engine in _name_roles(legacy, engines)]


def migration_yaml(legacy: str) -> str:
    """RLJob spec fields (YAML) that replace a legacy string, with notes on colocation."""
    engines = _parse_engines(legacy)
    roles = _name_roles(legacy, engines)
    names = {id(engine): role for role, engine in roles}
    lines: list[str] = []
    for role, engine in roles:
        lines += [f"{role}:", f"  backend: {engine.allocation}"]
        anchor = engine.colocated_with
        if anchor is not None:
            if engine.allocation.kind == "training" and anchor.allocation.kind == "training":
                note = f"shared {names[id(anchor)]}'s GPUs: critic and ref run in the actor's trainer pods by default"
            else:
                note = f"shared {names[id(anchor)]}'s GPUs: rollout servers and trainers get separate pods"
            lines.append(f"  # {note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Tree walking


@dataclass
class _Engine:
    allocation: Allocation
    label: str | None
    start: int  # 0-based offset of the engine in the spec
    colocated_with: _Engine | None = None


def _parse_engines(spec: str) -> list[_Engine]:
    if not isinstance(spec, str):
        raise AllocationSyntaxError(
            f"a backend string must be text, got {type(spec).__name__}", fix=f"write e.g. {default_training()}:d8"
        )
    if not spec.strip():
        raise AllocationSyntaxError(
            "the backend string is empty", fix=f"write backend:dims, e.g. {default_training()}:d8 or {server()}:d2t4"
        ).located(spec, 1)
    try:
        tree = _lark().parse(spec)
    except UnexpectedInput as exc:
        raise syntax_error(spec, exc) from None
    except LarkError as exc:  # pragma: no cover - defensive: any other parser failure
        raise AllocationSyntaxError(str(exc), fix=f"write backend:dims, e.g. {default_training()}:d8").located(
            spec, None
        ) from None
    engines: list[_Engine] = []
    for component in tree.children:
        assert isinstance(component, Tree)
        anchor: _Engine | None = None
        for node in component.children:
            assert isinstance(node, Tree)
            engine = _engine(spec, node)
            engine.colocated_with = anchor
            anchor = anchor or engine
            engines.append(engine)
    return engines


def _engine(spec: str, node: Tree[Token]) -> _Engine:
    start = node.meta.start_pos
    if node.data == "bare_dims":
        dims = node.children[0]
        assert isinstance(dims, Tree)
        return _engine_without_backend(spec, start, dims, label=None)
    if node.data == "bare_hybrid":
        text = spec[start : node.meta.end_pos].strip()
        raise MissingBackendError(
            "backend missing before the hybrid MoE layout", fix=f"write {either(f'{b}:{text}' for b in hybrid_names())}"
        ).located(spec, start + 1)
    if node.data == "label_only":
        label_node, dims = node.children
        assert isinstance(label_node, Tree) and isinstance(dims, Tree)
        return _engine_without_backend(spec, start, dims, label=str(label_node.children[0]))
    # with_backend: NAME label? layout
    name, *rest = node.children
    assert isinstance(name, Token)
    label = None
    if len(rest) == 2:
        label_node = rest[0]
        assert isinstance(label_node, Tree)
        label = str(label_node.children[0])
    layout = rest[-1]
    assert isinstance(layout, Tree)
    backend = _backend(spec, name)
    if layout.data == "hybrid":
        return _Engine(_hybrid(spec, backend, name, layout), label, start)
    # Inference servers reject letters outside their own outright; training backends take every
    # letter here and Allocation decides (a backend without p accepts p1, rejects p2).
    letters = spec_of(backend).letters.accepted if spec_of(backend).kind == "inference" else ALL_LETTERS
    sizes, columns = _dims(spec, layout, letters, backend)
    columns["backend"] = _col(name)
    return _Engine(_build(spec, columns, backend, ParallelDims(**sizes)), label, start)


def _engine_without_backend(spec: str, start: int, dims_node: Tree[Token], label: str | None) -> _Engine:
    sizes, _ = _dims(spec, dims_node, ALL_LETTERS, None)
    text = "".join(str(tok) for tok in dims_node.children)
    used = [letter for letter, field in LETTER_FIELD.items() if sizes.get(field, 1) > 1]
    choices = either(f"{backend}:{text}" for backend in (running(used) or names("training"))[:2])
    where = f" in {label}.backend" if label else ""
    raise MissingBackendError(
        f"backend missing: {text!r} has dimensions but no backend prefix", fix=f"write {choices}{where}"
    ).located(spec, start + 1)


def _backend(spec: str, name: Token) -> str:
    backend = str(name)
    if backend in names():
        return backend
    lower = backend.lower()
    fix = f"backend names are lower-case: write {lower}" if lower in names() else f"use one of {', '.join(names())}"
    raise AllocationSyntaxError(f"unknown backend {backend!r}", fix=fix).located(spec, _col(name))


def _dims(spec: str, node: Tree[Token], letters: str, backend: str | None) -> tuple[dict[str, int], dict[str, int]]:
    """Sizes by field name, and the column of each field's token."""
    sizes: dict[str, int] = {}
    columns: dict[str, int] = {}
    for tok in node.children:
        assert isinstance(tok, Token)
        letter, digits = tok[0], tok[1:]
        col = _col(tok)
        if letter not in LETTER_FIELD:
            raise AllocationSyntaxError(
                f"unknown dimension {letter!r}",
                fix="dimensions are d (data), t (tensor), p (pipeline), c (context), e (expert)",
            ).located(spec, col)
        field = LETTER_FIELD[letter]
        if letter not in letters and backend is not None:
            raise _letter_error(backend, letter, tok).located(spec, col)
        if digits.startswith("0"):
            if int(digits) == 0:
                raise AllocationSyntaxError(
                    f"size {tok} is 0", fix=f"sizes start at 1; leave {letter} out to mean {letter}1"
                ).located(spec, col + 1)
            raise AllocationSyntaxError(f"size {tok} has a leading zero", fix=f"write {letter}{int(digits)}").located(
                spec, col + 1
            )
        if field in sizes:
            raise AllocationSyntaxError(
                f"{letter} is given twice (columns {columns[field]} and {col})",
                fix=f"write each dimension once, e.g. keep {letter}{sizes[field]} or {tok}",
            ).located(spec, col)
        if len(digits) > len(str(MAX_SIZE)) or int(digits) > MAX_SIZE:
            raise AllocationValidationError(
                f"size {shorten(str(tok), 12)} is larger than any cluster",
                fix=f"sizes are at most {MAX_SIZE}",
                field=field,
            ).located(spec, col + 1)
        sizes[field] = int(digits)
        columns[field] = col
    return sizes, columns


def _letter_error(backend: str, letter: str, tok: Token) -> AllocationError:
    field = LETTER_FIELD[letter]
    return AllocationSyntaxError(
        f"{backend} takes only {server_letters(spec_of(backend).letters)}, not {FIELD_NAME[field]} ({tok})",
        fix=f"drop {tok}: context and expert parallelism are training dimensions",
        field=field,
    )


def _hybrid(spec: str, backend: str, name: Token, node: Tree[Token]) -> Allocation:
    attn_node, ffn_node = node.children
    assert isinstance(attn_node, Tree) and isinstance(ffn_node, Tree)
    if not spec_of(backend).letters.hybrid:
        raise AllocationValidationError(f"{backend} cannot take a hybrid attn/ffn layout", fix=hybrid_fix()).located(
            spec, _col(name)
        )
    attn, attn_cols = _section(spec, attn_node, "attn", ATTN_LETTERS)
    ffn, ffn_cols = _section(spec, ffn_node, "ffn", FFN_LETTERS)
    ffn_start = ffn_cols["section"]

    pp = attn.get("pp", 1)
    if ffn.get("pp", pp) != pp:
        raise AllocationValidationError(
            f"pipeline parallel size differs: attn p{pp}, ffn p{ffn['pp']}",
            fix=f"use the same p in both sections (write p{pp} in ffn, or leave it out)",
        ).located(spec, ffn_cols["pp"])
    world = attn.get("dp", 1) * attn.get("tp", 1) * pp * attn.get("cp", 1)
    etp, ep = ffn.get("tp", 1), ffn.get("ep", 1)
    grid = pp * etp * ep
    if "dp" in ffn:
        if ffn["dp"] * grid != world:
            raise AllocationValidationError(
                f"attn and ffn sections must cover the same GPUs: attn d*t*p*c = {world}, "
                f"ffn d*t*p*e = {ffn['dp'] * grid}",
                fix=f"leave d out of ffn to derive it, or make ffn d*t*p*e = {world}",
            ).located(spec, ffn_cols["dp"])
    elif world % grid != 0:
        raise AllocationValidationError(
            f"cannot derive the ffn d: the attn world size {world} is not divisible by ffn t*p*e = {grid}",
            fix=f"choose ffn t and e so that t*p*e divides {world}",
        ).located(spec, ffn_start)
    dims = ParallelDims(dp=attn.get("dp", 1), tp=attn.get("tp", 1), pp=pp, cp=attn.get("cp", 1), ep=ep, etp=etp)
    columns = {**attn_cols, "ep": ffn_cols.get("ep", ffn_start), "etp": ffn_cols.get("tp", ffn_start)}
    return _build(spec, columns, backend, dims, hybrid=True)


def _section(spec: str, node: Tree[Token], expected: str, letters: str) -> tuple[dict[str, int], dict[str, int]]:
    name, dims_node = node.children
    assert isinstance(name, Token) and isinstance(dims_node, Tree)
    if str(name) != expected:
        other = "ffn" if expected == "attn" else "attn"
        hint = (
            "write the attn section first, then ffn: (attn:...|ffn:...)"
            if str(name) == other
            else f"name the section {expected}: (attn:...|ffn:...)"
        )
        raise AllocationSyntaxError(f"expected the {expected} section, got {str(name)!r}", fix=hint).located(
            spec, _col(name)
        )
    for tok in dims_node.children:
        assert isinstance(tok, Token)
        if tok[0] in LETTER_FIELD and tok[0] not in letters:
            wrong = (
                "expert parallel belongs in the ffn section"
                if tok[0] == "e"
                else ("context parallel belongs in the attn section")
            )
            raise AllocationSyntaxError(
                f"the {expected} section takes only {', '.join(letters)}, not {tok}", fix=f"move {tok}: {wrong}"
            ).located(spec, _col(tok))
    sizes, columns = _dims(spec, dims_node, letters, None)
    columns["section"] = _col(name)
    return sizes, columns


def _build(spec: str, columns: dict[str, int], backend: str, dims: ParallelDims, hybrid: bool = False) -> Allocation:
    try:
        return Allocation(backend, dims, hybrid=hybrid)
    except AllocationError as err:
        raise err.located(spec, columns.get(err.field or "", columns.get("backend"))) from None


# ---------------------------------------------------------------------------
# Legacy strings


def _name_roles(spec: str, engines: list[_Engine]) -> list[tuple[str, _Engine]]:
    """Give each engine of a legacy string an RLJob field name: its label, else rollout/actor."""
    roles: list[tuple[str, _Engine]] = []
    taken: dict[str, _Engine] = {}
    for engine in engines:
        role = engine.label or ("rollout" if engine.allocation.kind == "inference" else "actor")
        if role in taken:
            raise LegacySpecError(
                f"two engines would both become {role}.backend",
                fix=f"name them, e.g. {engine.allocation.backend}[critic]:..., then run "
                "treetrain alloc --migrate again",
                fields=[],
            ).located(spec, engine.start + 1)
        taken[role] = engine
        roles.append((role, engine))
    return roles


def _legacy_error(spec: str, engines: list[_Engine]) -> LegacySpecError:
    fields = [(role, str(engine.allocation)) for role, engine in _name_roles(spec, engines)]
    column = next((i + 1 for i, ch in enumerate(spec) if ch in "+|["), None)
    if len(engines) == 1:
        problem = "component names in brackets are from the legacy allocation mode"
    else:
        problem = "multi-component strings ('+' and '|') are from the legacy allocation mode"
    write = ", ".join(f"{role}.backend: {backend}" for role, backend in fields)
    fix = f"give each engine its own backend field: {write} (treetrain alloc --migrate prints them)"
    return LegacySpecError(problem, fix=fix, fields=fields).located(spec, column)


def _col(tok: Token) -> int:
    return (tok.start_pos or 0) + 1
