"""LoRA's names and shapes, torch-free: which projections an adapter can target, how
``targetModules`` resolves against a model, and the adapter tensors of each target (what the
memory plan counts; the engines build the same tensors).

A target is named as Hugging Face names the projection (and as a PEFT adapter directory and
vLLM name it): ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (attention), ``gate_proj``,
``up_proj``, ``down_proj`` (the SwiGLU FFN; in a mixture-of-experts layer, every expert's own
projection). ``all-linear`` is all of them: every linear layer of the decoder except the LM
head, the embedding and a MoE router (as PEFT's ``all-linear``).

One adapter per target and layer: ``A [r, in]`` and ``B [out, r]`` (an expert's ``[E, r, in]``
and ``[E, out, r]``), ``y = W x + (alpha / r) B A x``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from treetrain.alloc.shapes import Param

ALL_LINEAR = "all-linear"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FFN_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + FFN_TARGETS
# Each target's weight in the memory plan's names (:func:`treetrain.alloc.shapes.layer_params`).
PLAN_NAME = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
# Row-parallel projections (their input is split over tensor ranks); the others are column-parallel.
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
# Model families whose decoder layers have every target (attention plus a SwiGLU FFN or experts).
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": TARGETS,
    "mistral": TARGETS,
    "qwen2": TARGETS,
    "qwen3": TARGETS,
    "qwen3_moe": TARGETS,
}


class LoraTargetError(ValueError):
    """``targetModules`` names a module the model does not have (the message lists the valid ones)."""


def valid_targets(family: str) -> tuple[str, ...]:
    """The targets a model of ``family`` (its config's ``model_type``) has."""
    found = FAMILY_TARGETS.get(family)
    if found is None:
        raise LoraTargetError(f"LoRA is not built for model_type {family!r}; it is for {', '.join(FAMILY_TARGETS)}")
    return found


def resolve_targets(
    target_modules: str | Sequence[str], valid: Sequence[str] = TARGETS, *, model: str | None = None
) -> tuple[str, ...]:
    """``targetModules`` as the targets it names, in :data:`TARGETS` order: ``all-linear`` is
    every one of ``valid``; otherwise one name or a list of them, each among ``valid`` (else
    :class:`LoraTargetError` naming the first unknown one, ``model``, and every valid name)."""
    if isinstance(target_modules, str):
        if target_modules == ALL_LINEAR:
            return tuple(valid)
        target_modules = [target_modules]
    if not target_modules:
        raise LoraTargetError(f"targetModules is empty; fix: {ALL_LINEAR} or some of {', '.join(valid)}")
    for name in target_modules:
        if name not in valid:
            why = "not a projection LoRA can target" if model is None else f"which {model} does not have"
            raise LoraTargetError(f"targetModules names {name!r}, {why}; valid: {ALL_LINEAR}, {', '.join(valid)}")
    chosen = set(target_modules)
    return tuple(t for t in TARGETS if t in chosen)


@dataclass(frozen=True, slots=True)
class LoraShape:
    """What the memory plan needs of an adapter: its rank and the targets it covers."""

    rank: int
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise LoraTargetError(f"LoRA rank {self.rank!r} is not a whole number >= 1; fix: e.g. 8, 16 or 64")
        resolve_targets(list(self.targets))

    def covers(self, plan_name: str) -> str | None:
        """The target of one of the plan's weights (``3.wq``, ``3.experts.w1``), or None."""
        short = plan_name.rsplit(".", 1)[-1]
        for target in self.targets:
            if PLAN_NAME[target] == short:
                return target
        return None


def adapter_params(base: Iterable[Param], lora: LoraShape) -> list[Param]:
    """The adapter tensors on ``base`` (a stage's parameters), sliced as the engines slice them
    (``engines/lora/linear.py``, ``archon/lora.py``): for a column-parallel weight ``[out, in]``
    (``tp_dim`` 0) ``A [r, in]`` whole and ``B [out, r]`` split by rows like the weight; for a
    row-parallel one (``tp_dim`` 1) ``A`` split by columns like the weight and ``B`` whole. An
    expert weight's ``A [E, r, in]`` and ``B [E, out, r]`` split over ``e`` by expert; FSDP over
    the expert-data ranks shards them on the dimension Archon's ``fsdp_placement`` names (never
    the experts'). FSDP's dim-0 sharding of dense ones is the same rule as the weights'."""
    out: list[Param] = []
    for p in base:
        if lora.covers(p.name) is None:
            continue
        r = lora.rank
        if p.expert:
            e, n_out, n_in = p.shape
            gate_or_up = p.ffn_dim == 1  # w1/w3 [E, I, h]; w2 [E, h, I]
            out += [
                Param(f"{p.name}.A", (e, r, n_in), expert=True, fsdp_dim=2 if gate_or_up else 1),
                Param(f"{p.name}.B", (e, n_out, r), expert=True, fsdp_dim=1),
            ]
            continue
        n_out, n_in = p.shape
        out += [
            Param(f"{p.name}.A", (r, n_in), 1 if p.tp_dim == 1 else None),
            Param(f"{p.name}.B", (n_out, r), 0 if p.tp_dim == 0 else None),
        ]
    return out
