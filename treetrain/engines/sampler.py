"""Local rollout's sampler and the Hugging Face weights an engine hands out: what the core does
once for every engine (a transformers causal LM built from the config on first use, refreshed in
place after every step and load) from the one hook an engine with its own model supplies
(:meth:`LocalSampler._sampler_weights`)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from treetrain.engines.state import EngineState


class LocalSampler(EngineState):
    """Hugging Face weights out of the engine, and the module local rollout samples from."""

    _sampler: torch.nn.Module | None

    @abstractmethod
    def export_hf(self, path: Path) -> None:
        """Hugging Face weights (safetensors + config) for rollout servers to load."""

    def hf_weights(self) -> dict[str, torch.Tensor] | None:
        """The full Hugging Face weights by name on the main rank (None on the others), what a
        distributed weight sync broadcasts; every rank calls it. The default goes through
        :meth:`export_hf` and a temporary directory; engines that gather directly override it."""
        import tempfile

        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory(prefix="treetrain-weights-") as tmp:
            self.export_hf(Path(tmp))
            if not self.layout.is_main:
                return None
            state: dict[str, torch.Tensor] = {}
            for f in sorted(Path(tmp).glob("*.safetensors")):
                state.update(load_file(f))
            return state

    def _sampler_weights(self) -> Mapping[str, torch.Tensor] | None:
        """Full Hugging Face weights (on-disk names, one tensor per expert) on every rank, for
        the local-rollout sampler (a collective); None: :attr:`model` is the sampler itself."""
        return None

    def sampling_model(self) -> torch.nn.Module:
        """What local rollout samples from: a module called like a Hugging Face causal LM
        (attention masks, KV caches), kept up to date with the trained weights. Engines with
        their own models get a transformers model built from the config on first use (every
        rank: a collective) and refreshed in place after every step and load, so the rollout's
        KV-cache check (parameter versions) sees the change; otherwise :attr:`model` itself."""
        if self._sampler is None:
            weights = self._sampler_weights()
            if weights is None:
                return self.model
            from transformers import AutoModelForCausalLM

            auto: Any = AutoModelForCausalLM  # untyped
            dtype = getattr(torch, self.settings.dtype)
            model = auto.from_config(self.source.config, dtype=dtype).to(self.layout.device)
            self._sampler = model.eval().requires_grad_(False)
            _copy_hf(self._sampler, weights)
        return self._sampler

    def _refresh_sampler(self) -> None:
        """Bring :meth:`sampling_model` up to the new weights (after a step or a load)."""
        if self._sampler is not None:
            weights = self._sampler_weights()
            assert weights is not None
            _copy_hf(self._sampler, weights)


def _copy_hf(model: torch.nn.Module, hf: Mapping[str, torch.Tensor]) -> None:
    """Copy on-disk Hugging Face tensors into transformers' in-memory ones, which fuse a MoE
    layer's experts (``experts.gate_up_proj [E, 2f, h]`` from the per-expert gate and up,
    ``experts.down_proj [E, h, f]``)."""
    with torch.no_grad():
        for name, target in model.named_parameters():  # a tied head once
            if name in hf:
                target.copy_(hf[name])
                continue
            base, kind = name.rsplit(".", 1)
            count = target.shape[0]
            if kind == "gate_up_proj":
                gate = [hf[f"{base}.{e}.gate_proj.weight"] for e in range(count)]
                up = [hf[f"{base}.{e}.up_proj.weight"] for e in range(count)]
                target.copy_(torch.cat([torch.stack(gate), torch.stack(up)], dim=1))
            elif kind == "down_proj":
                target.copy_(torch.stack([hf[f"{base}.{e}.down_proj.weight"] for e in range(count)]))
            else:
                raise KeyError(f"no Hugging Face weights for {name}")
