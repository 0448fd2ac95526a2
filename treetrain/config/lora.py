"""``actor.lora``: train a low-rank adapter over a frozen base model instead of every weight
(docs/engines.md, LoRA). Torch-free: the trainer, ``rljob plan`` and the operator validate it.

The names are ours (``rank``, ``alpha``, ``dropout``, ``targetModules``, ``sync``); the adapter
a run exports is a PEFT adapter directory (``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules``). Which modules exist depends on the model: config validation refuses a
name no supported model has, the engine one its model lacks, each with the valid names.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from treetrain.alloc import registry
from treetrain.alloc.lora import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    FFN_TARGETS,
    TARGETS,
    LoraShape,
    LoraTargetError,
    resolve_targets,
)
from treetrain.alloc.model import Allocation

LoraSync = Literal["adapter", "merged"]


class LoraSettings(BaseModel):
    """A LoRA adapter on the actor: ``W x + (alpha / rank) B A x`` on each targeted projection,
    ``A`` and ``B`` trained in fp32, the base weights frozen (no gradients, no optimizer state)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True, frozen=True)

    rank: int = Field(ge=1, le=4096, description="The adapter's rank r (the inner width of B A).")
    alpha: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="The scale's numerator: the update is (alpha / rank) B A; unset: rank (a scale of 1).",
    )
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Dropout on the adapter's input (training only); 0: none."
    )
    target_modules: str | list[str] = Field(
        default=ALL_LINEAR,
        description=f"{ALL_LINEAR} (every decoder projection: {', '.join(TARGETS)}; not the LM head, embedding or a "
        "MoE router) or a list of them; in a mixture-of-experts layer gate/up/down_proj are every expert's.",
    )
    sync: LoraSync = Field(
        default="adapter",
        description="What rollout servers get after each step: adapter (the adapter alone, loaded under a "
        "versioned name) or merged (W + (alpha/rank) B A through the full-weight sync, for servers without LoRA).",
    )

    @property
    def scale(self) -> float:
        """``alpha / rank``: what multiplies ``B A``."""
        return (self.alpha if self.alpha is not None else float(self.rank)) / self.rank

    @property
    def lora_alpha(self) -> float:
        """``alpha`` as PEFT's ``lora_alpha`` (``rank`` when unset)."""
        return self.alpha if self.alpha is not None else float(self.rank)

    def targets(self, valid: tuple[str, ...] = TARGETS, *, model: str | None = None) -> tuple[str, ...]:
        """The projections ``targetModules`` names among ``valid`` (``model``'s: a
        :class:`~treetrain.alloc.lora.LoraTargetError` names a missing one and the valid ones)."""
        return resolve_targets(self.target_modules, valid, model=model)

    def shape(self) -> LoraShape:
        """What the memory plan counts."""
        return LoraShape(self.rank, self.targets())


def lora_problems(lora: LoraSettings, allocation: Allocation | None) -> list[tuple[str, str]]:
    """What config validation refuses of ``actor.lora`` (``allocation``: the actor's layout,
    None when it did not parse): a target no model has, and adapters on experts split by an
    ffn ``t`` (expert tensor parallel), which no engine builds."""
    if allocation is not None and not registry.spec_of(allocation.backend).lora:
        lora_engines = registry.either(f"{n}:..." for n in registry.names("training") if registry.spec_of(n).lora)
        fix = f"use an {lora_engines} backend, or drop actor.lora"
        return [("actor.lora", f"LoRA is not built for the {allocation.backend} engine yet; fix: {fix}")]
    try:
        targets = lora.targets()
    except LoraTargetError as err:
        return [("actor.lora.targetModules", str(err).removeprefix("targetModules "))]
    if allocation is not None and allocation.dims.etp > 1 and set(targets) & set(FFN_TARGETS):
        return [
            (
                "actor.lora.targetModules",
                f"adapters on experts split by an ffn t{allocation.dims.etp} are not built; fix: drop the ffn t "
                f"from {allocation}, or target only {', '.join(ATTENTION_TARGETS)}",
            )
        ]
    return []
