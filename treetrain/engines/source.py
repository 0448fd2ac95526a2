"""Where every engine's model comes from, and the one reader of Hugging Face safetensors.

:class:`ModelSource`: a model path (a Hugging Face directory, a hub name or ``builtin:NAME``)
resolved once: a packaged built-in model is converted into the cache on first use and its
Hugging Face config is read; every engine takes that resolved object.

:class:`SafetensorsFiles`: the tensors of a Hugging Face directory, memory-mapped and read
lazily, found the same way for every engine: through ``model.safetensors.index.json`` when the
directory has one, else in every ``*.safetensors`` file of the directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treetrain.config import ModelSettings
from treetrain.engines import builtin
from treetrain.engines.errors import EngineConfigError

__all__ = ["ModelSource", "SafetensorsFiles"]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model path, resolved once: its settings, its directory and its Hugging Face config.

    ``random``: a random built-in model (``builtin:tiny-llama``), built from ``config`` alone,
    with no directory (``directory`` is None). Otherwise ``directory`` is what transformers
    loads: the path itself, or the cache directory a packaged built-in model was converted into.
    """

    settings: ModelSettings
    directory: str | None
    config: Any  # transformers.PretrainedConfig, attention dropout off; build_model copies it
    random: bool

    @property
    def path(self) -> str:
        return self.settings.path

    @classmethod
    def resolve(cls, model: ModelSettings | str, log: Callable[[str], None] | None = None) -> ModelSource:
        """Check the path, convert a packaged built-in model on first use, read the config."""
        from transformers import AutoConfig

        settings = ModelSettings(path=model) if isinstance(model, str) else model
        builtin.check_path(settings.path)
        fields = builtin.random_config(settings.path)
        if fields is not None:
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            directory = None
        else:
            directory = builtin.local_dir(settings.path, log)
            try:
                config = AutoConfig.from_pretrained(directory)
            except (OSError, ValueError) as err:
                raise EngineConfigError(
                    f"cannot load model.path {settings.path!r}: {err}. Give a local Hugging Face model directory "
                    f"(config.json + weights), a hub name this machine can download, or one of "
                    f"{', '.join(builtin.PREFIX + n for n in builtin.NAMES)}"
                ) from None
        config.attention_dropout = 0.0
        return cls(settings=settings, directory=directory, config=config, random=directory is None)

    def load_tokenizer(self) -> Any | None:
        """The model's tokenizer; None for a random built-in model, which has none."""
        if self.directory is None:
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.directory)
        except (OSError, ValueError) as err:
            raise EngineConfigError(
                f"cannot load a tokenizer from model.path {self.path!r} ({self.directory}): {err}"
            ) from None


class SafetensorsFiles:
    """The tensors of a Hugging Face directory (one file, or shards with or without an index),
    each file opened on first use. A key held by two files is an error naming both."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self._open: dict[str, Any] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise EngineConfigError(
                    f"{self.dir} has no safetensors weights (no *.safetensors file, no model.safetensors.index.json)"
                )
            weight_map = {}
            for name in files:
                for key in self._handle(name).keys():  # noqa: SIM118  # a safe_open handle, not a dict
                    if key in weight_map:
                        raise EngineConfigError(f"{self.dir}: tensor {key!r} is in both {weight_map[key]} and {name}")
                    weight_map[key] = name
        self.weight_map = weight_map

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(str(self.dir / file), framework="pt")
        return self._open[file]

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def _file(self, key: str) -> str:
        file = self.weight_map.get(key)
        if file is None:
            raise EngineConfigError(f"{self.dir} has no tensor {key!r}; is it a {key.split('.')[0]} checkpoint?")
        return file

    def get(self, key: str) -> torch.Tensor:
        """One whole tensor, in its stored dtype."""
        tensor: torch.Tensor = self._handle(self._file(key)).get_tensor(key)
        return tensor

    def __call__(self, key: str, dim: int, index: int, parts: int) -> torch.Tensor:
        """Part ``index`` of ``parts`` equal pieces of a 1-d or 2-d tensor along ``dim`` (0 or
        1), in fp32, reading only that piece from disk."""
        piece = self._handle(self._file(key)).get_slice(key)
        size = piece.get_shape()[dim] // parts
        lo, hi = index * size, (index + 1) * size
        out: torch.Tensor = piece[lo:hi] if dim == 0 else piece[:, lo:hi]
        return out.float()
