"""A LoRA adapter as a PEFT adapter directory, and the adapter merged into full weights.

The directory is what ``peft.PeftModel.from_pretrained(base, path)`` and vLLM's LoRA loader
read: ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``
...) and ``adapter_model.safetensors`` with one ``lora_A`` ``[r, in]`` and one ``lora_B``
``[out, r]`` per targeted module, named ``base_model.model.<Hugging Face module>.lora_A.weight``.
A mixture-of-experts layer's experts are named one by one
(``model.layers.3.mlp.experts.7.gate_proj``), as their weights are on disk.

Every engine hands the core its adapter as full tensors by Hugging Face module name
(``model.layers.0.self_attn.q_proj`` -> ``(A, B)``); this module is the one place that spells
the file format.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from treetrain.config.lora import LoraSettings
from treetrain.engines.errors import EngineConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight$")

Adapter = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r]), full tensors


def key(module: str, which: str) -> str:
    """The safetensors key of ``module``'s ``A`` or ``B``."""
    return f"{PREFIX}{module}.lora_{which}.weight"


def adapter_config(lora: LoraSettings, targets: tuple[str, ...], base: str) -> dict[str, Any]:
    """``adapter_config.json`` for ``lora`` over the model at ``base``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write(path: Path, adapter: Mapping[str, tuple[torch.Tensor, torch.Tensor]], config: Mapping[str, Any]) -> None:
    """The adapter directory at ``path`` (fp32 tensors, as trained)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in sorted(adapter.items()):
        tensors[key(module, "A")] = a.detach().to("cpu", torch.float32).contiguous()
        tensors[key(module, "B")] = b.detach().to("cpu", torch.float32).contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True))


def read(path: Path, lora: LoraSettings) -> Adapter:
    """The adapter of a PEFT directory, checked against this run's ``lora`` (its rank and
    scale must agree; an :class:`EngineConfigError` with the fix otherwise)."""
    from safetensors.torch import load_file

    config_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights.is_file():
        raise EngineConfigError(f"{path} is not a PEFT adapter directory (no {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads(config_file.read_text())
    if config.get("r") != lora.rank or float(config.get("lora_alpha", lora.rank)) != lora.lora_alpha:
        raise EngineConfigError(
            f"the adapter in {path} has rank {config.get('r')} and alpha {config.get('lora_alpha')}, this run "
            f"{lora.rank} and {lora.lora_alpha}; fix: set actor.lora.rank and alpha to the adapter's"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(weights)).items():
        m = _KEY.fullmatch(name)
        if m is None:
            raise EngineConfigError(
                f"{weights}: {name!r} is not a LoRA weight (base_model.model.<module>.lora_A.weight)"
            )
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor.float()
    return {module: (ab["A"], ab["B"]) for module, ab in pairs.items() if set(ab) == {"A", "B"}}


def merge(
    hf: Mapping[str, torch.Tensor], adapter: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scale: float
) -> dict[str, torch.Tensor]:
    """Full Hugging Face weights with the adapter merged in: ``W + scale * B @ A`` for every
    adapted module (computed in fp32, kept in each weight's dtype); the rest as it is."""
    out = dict(hf)
    for module, (a, b) in adapter.items():
        name = f"{module}.weight"
        w = out[name]
        delta = (b.float() @ a.float()) * scale
        out[name] = (w.float() + delta.to(w.device)).to(w.dtype)
    return out


def initial(module: str, shape_a: tuple[int, int], out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A new adapter of one module, the same on every engine and layout: ``A`` as
    ``nn.Linear`` initialises its weight (Kaiming-uniform, bound ``1/sqrt(in)``) from a
    generator seeded by ``seed`` and the module's name, ``B`` zeros (so the adapted model
    starts equal to the base)."""
    r, fan_in = shape_a
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(module.encode()))
    bound = fan_in**-0.5
    a = (torch.rand((r, fan_in), generator=g, dtype=torch.float32) * 2 - 1) * bound
    return a, torch.zeros((out_features, r), dtype=torch.float32)
