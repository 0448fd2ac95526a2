"""Parallel layouts of one engine: which backend, which degrees, how many GPUs.

Letters in backend strings and the fields they set:

    d  dp   data parallel (for sglang/vllm: server instances)
    t  tp   tensor parallel (in a hybrid ffn section: etp, expert tensor parallel)
    p  pp   pipeline parallel
    c  cp   context parallel
    e  ep   expert parallel (never adds GPUs: it re-slices the same grid)

World size is ``dp * tp * pp * cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.alloc import registry
from treetrain.alloc.errors import AllocationValidationError
from treetrain.alloc.spec import EngineLetters, EngineSpec, Kind

# Bounds that no cluster reaches: they keep a typo (d1000000) or a hostile string from planning
# millions of pods, and every size within what Python parses without a digit limit.
MAX_SIZE = 65536
MAX_WORLD_SIZE = 1 << 20
ATTN_LETTERS = "dtpc"
FFN_LETTERS = "dtpe"

LETTER_FIELD = {"d": "dp", "t": "tp", "p": "pp", "c": "cp", "e": "ep"}
LETTER_WORD = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
FIELD_NAME = {
    "dp": "data parallel",
    "tp": "tensor parallel",
    "pp": "pipeline parallel",
    "cp": "context parallel",
    "ep": "expert parallel",
    "etp": "expert tensor parallel",
}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Parallel degrees of one engine; every degree defaults to 1."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AllocationValidationError(
                    f"{FIELD_NAME[name]} size must be a whole number >= 1, got {value!r}",
                    fix="sizes start at 1; leave a dimension out to mean 1",
                    field=name,
                )
            if value > MAX_SIZE:
                raise AllocationValidationError(
                    f"{FIELD_NAME[name]} size {value} is larger than any cluster",
                    fix=f"sizes are at most {MAX_SIZE}",
                    field=name,
                )
        if self.world_size > MAX_WORLD_SIZE:
            raise AllocationValidationError(
                f"world size {self.world_size} (d*t*p*c) is larger than any cluster",
                fix=f"the world size is at most {MAX_WORLD_SIZE} GPUs",
                field="dp",
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """Expert data parallel size: the ``d`` of the expert grid ``(pp, edp, ep, etp)``."""
        return self.world_size // (self.pp * self.etp * self.ep)


@dataclass(frozen=True, slots=True)
class Allocation:
    """One engine's backend and parallel layout, validated on construction.

    ``hybrid`` marks the MoE form ``backend:(attn:...|ffn:...)``, where attention and
    expert layers are sliced differently (Megatron's parallel folding); only that form
    can set ``etp``.
    """

    backend: str
    dims: ParallelDims = ParallelDims()
    hybrid: bool = False

    def __post_init__(self) -> None:
        if self.backend not in registry.ENGINES:
            raise AllocationValidationError(
                f"unknown backend {self.backend!r}",
                fix=f"use one of {', '.join(registry.names())} (names are lower-case)",
                field="backend",
            )
        if self.hybrid and not self.letters.hybrid:
            raise AllocationValidationError(
                f"{self.backend} cannot take a hybrid attn/ffn layout", fix=hybrid_fix(), field="backend"
            )
        if not self.hybrid and self.dims.etp != 1:
            raise AllocationValidationError(
                "expert tensor parallel is only set by the t of a hybrid ffn section",
                fix=f"write {self.backend}:(attn:...|ffn:t{self.dims.etp}...)",
                field="etp",
            )
        self._check_letters()
        self._check_expert_grid()

    def _check_letters(self) -> None:
        allowed = self.letters.accepted if not self.hybrid else ATTN_LETTERS + FFN_LETTERS
        for letter, name in LETTER_FIELD.items():
            if letter in allowed or getattr(self.dims, name) == 1:
                continue
            value = getattr(self.dims, name)
            if self.kind == "inference":
                fix = (
                    f"{self.backend} takes only {server_letters(self.letters)}; "
                    f"{letter} is a training dimension: drop {letter}{value}"
                )
                note = ""
            else:
                others = registry.running(letter)
                fix = (
                    f"use {registry.either(others)} for {FIELD_NAME[name]}, e.g. {others[0]}:{self._plain_dims()}"
                    if others
                    else f"drop {letter}{value}"
                )
                words = registry.either((LETTER_WORD[k] for k in self.letters.accepted), last="and")
                note = f": {self.backend} shards {words} only"
            raise AllocationValidationError(
                f"{self.backend} does not support {FIELD_NAME[name]} ({letter}{value}){note}", fix=fix, field=name
            )

    def _check_expert_grid(self) -> None:
        # Experts are laid out on a (pp, edp, ep, etp) grid over the same GPUs, so
        # pp * etp * ep must divide the world size exactly.
        d = self.dims
        if d.ep == 1 and d.etp == 1:
            return
        grid = d.pp * d.etp * d.ep
        if d.world_size % grid == 0:
            return
        room = d.world_size // (d.pp * d.etp) if d.world_size % (d.pp * d.etp) == 0 else 1
        choices = ", ".join(f"e{k}" for k in _divisors(room))
        raise AllocationValidationError(
            f"expert parallel size e{d.ep} does not fit the GPU grid: pp*etp*ep = "
            f"{d.pp}*{d.etp}*{d.ep} = {grid} does not divide the world size {d.world_size} (d*t*p*c)",
            fix=f"pick e from {choices}, or grow d so that {grid} divides the world size",
            field="ep",
        )

    @property
    def spec(self) -> EngineSpec:
        """This backend's description in the engine registry (:mod:`treetrain.alloc.registry`)."""
        return registry.spec_of(self.backend)

    @property
    def kind(self) -> Kind:
        return self.spec.kind

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def alignment(self) -> int:
        """Tokens of a packed tree split evenly over this many ranks: tensor parallel (sequence
        parallel) times context parallel, which splits each tree's rows. Config validation
        checks the micro-batch cap against it and the engines pack with it."""
        return self.dims.tp * self.dims.cp

    @property
    def letters(self) -> EngineLetters:
        """Which letters this allocation's engine takes and runs (its description's)."""
        return self.spec.letters

    def not_yet_run(self) -> tuple[str, int, str] | None:
        """The first letter set above 1 that this engine does not run yet: (letter, size, why);
        None when the engine runs every letter here."""
        for letter, why in self.letters.not_yet.items():
            size = getattr(self.dims, LETTER_FIELD[letter])
            if size > 1:
                return letter, size, why
        return None

    @property
    def instances(self) -> int:
        """Inference: number of server instances (``d``)."""
        return self.dims.dp

    @property
    def gpus_per_instance(self) -> int:
        """Inference: GPUs of one server instance (``t * p``)."""
        return self.dims.tp * self.dims.pp

    def _plain_dims(self) -> str:
        d = self.dims
        return _dims_text([("d", d.dp), ("p", d.pp), ("t", d.tp), ("c", d.cp), ("e", d.ep)])

    def __str__(self) -> str:
        """The canonical string: it parses back to an equal allocation."""
        if not self.hybrid:
            return f"{self.backend}:{self._plain_dims()}"
        d = self.dims
        attn = _dims_text([("d", d.dp), ("p", d.pp), ("t", d.tp), ("c", d.cp)])
        ffn = _dims_text([("d", d.edp), ("p", d.pp), ("t", d.etp), ("e", d.ep)])
        return f"{self.backend}:(attn:{attn}|ffn:{ffn})"

    def to_dict(self) -> dict[str, object]:
        """The fields ``treetrain alloc --json`` prints."""
        d = self.dims
        out: dict[str, object] = {
            "backend": self.backend,
            "kind": self.kind,
            "dp": d.dp,
            "tp": d.tp,
            "pp": d.pp,
            "cp": d.cp,
            "ep": d.ep,
            "etp": d.etp,
            "world_size": self.world_size,
        }
        if self.kind == "inference":
            out["instances"] = self.instances
            out["gpus_per_instance"] = self.gpus_per_instance
        if self.hybrid:
            out["attn"] = {"dp": d.dp, "tp": d.tp, "pp": d.pp, "cp": d.cp, "world_size": d.world_size}
            out["ffn"] = {"dp": d.edp, "tp": d.etp, "pp": d.pp, "ep": d.ep, "world_size": d.world_size}
        out["canonical"] = str(self)
        return out


def server_letters(letters: EngineLetters) -> str:
    """``d (instances), t and p``: a rollout server's letters as messages name them."""
    return registry.either((f"{k} (instances)" if k == "d" else k for k in letters.accepted), last="and")


def hybrid_fix() -> str:
    """The fix for a hybrid layout on a backend that takes none: the backends that do."""
    hybrid = registry.hybrid_names()
    return f"hybrid MoE layouts need {registry.either(hybrid)}, e.g. {hybrid[0]}:(attn:d4t2|ffn:d2t2e2)"


def _dims_text(items: list[tuple[str, int]]) -> str:
    """``d4t2``: the letters whose size is not 1, or ``d1`` when all are 1."""
    text = "".join(f"{letter}{size}" for letter, size in items if size != 1)
    return text or "d1"
