"""LoRA in the engine core: what every engine offers once its model carries an adapter.

- :attr:`lora`: the run's :class:`~treetrain.config.lora.LoraSettings` (None: every weight trains).
- :meth:`export_adapter`: a PEFT adapter directory (rank 0 writes, every rank joins the gather).
- :meth:`adapter_weights`: the same tensors in memory, by their safetensors key, on rank 0.
- :meth:`load_adapter`: start from an adapter directory (every rank reads it).
- ``hf_weights`` / ``export_hf`` / local rollout's weights: the *merged* model,
  ``W + (alpha / r) B A`` (what a server without LoRA loads); the engine's own weights stay
  unmerged.

An engine supplies three hooks: :meth:`_lora_modules` (each adapted Hugging Face module and its
``(in, out)`` features), :meth:`_lora_full` (the full adapter, gathered) and
:meth:`_lora_set` (load full tensors into its shards).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from treetrain.config.lora import LoraSettings
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.lora import peft_files
from treetrain.engines.lora.peft_files import Adapter
from treetrain.engines.sampler import LocalSampler


class Adapters(LocalSampler):
    """The LoRA part of an engine (every method a collective: every rank calls it)."""

    # -- the engine's hooks --------------------------------------------------------------------
    def _lora_modules(self) -> dict[str, tuple[int, int]]:
        """Every adapted module by Hugging Face name (an expert's one by one) and its
        ``(in_features, out_features)``."""
        raise EngineConfigError(f"LoRA is not built in the {self.engine_name} engine yet; fix: drop actor.lora")

    def _lora_full(self, *, everywhere: bool, grads: bool = False) -> Adapter | None:
        """The full adapter by Hugging Face module name on rank 0 (``everywhere``: on every
        rank); None on the others. ``grads``: its full gradients instead (zeros where none)."""
        raise EngineConfigError(f"LoRA is not built in the {self.engine_name} engine yet; fix: drop actor.lora")

    def _lora_set(self, adapter: Adapter) -> None:
        """Load a full adapter (on every rank) into this rank's shards of it."""
        raise EngineConfigError(f"LoRA is not built in the {self.engine_name} engine yet; fix: drop actor.lora")

    # -- what the engine offers ----------------------------------------------------------------
    def _need_lora(self, what: str) -> LoraSettings:
        if self.lora is None:
            raise EngineConfigError(f"{what} needs an adapter, but this engine trains every weight (no actor.lora)")
        return self.lora

    def _init_adapter(self) -> None:
        """A new adapter (B = 0: the model starts as the base), the same on every engine and layout."""
        lora = self._need_lora("a new adapter")
        seed = self.settings.seed
        fresh = {
            m: peft_files.initial(m, (lora.rank, n_in), n_out, seed)
            for m, (n_in, n_out) in self._lora_modules().items()
        }
        self._lora_set(fresh)

    def adapter_weights(self) -> dict[str, torch.Tensor] | None:
        """The adapter's tensors (fp32, on the CPU) by their key in ``adapter_model.safetensors``
        on rank 0, None on the others; every rank calls it."""
        self._need_lora("adapter_weights")
        full = self._lora_full(everywhere=False)
        if full is None:
            return None
        out: dict[str, torch.Tensor] = {}
        for module, (a, b) in sorted(full.items()):
            out[peft_files.key(module, "A")] = a.detach().to("cpu", torch.float32)
            out[peft_files.key(module, "B")] = b.detach().to("cpu", torch.float32)
        return out

    def adapter_grads(self) -> Adapter:
        """The adapter's full gradients by Hugging Face module name, on every rank (tests and
        parity scripts; every rank calls it)."""
        self._need_lora("adapter_grads")
        full = self._lora_full(everywhere=True, grads=True)
        assert full is not None
        return full

    def export_adapter(self, path: Path) -> None:
        """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
        that ``peft.PeftModel.from_pretrained(base, path)`` and vLLM load; rank 0 writes, every
        rank joins the gather."""
        import torch.distributed as dist

        lora = self._need_lora("export_adapter")
        full = self._lora_full(everywhere=False)
        if full is not None:
            config = peft_files.adapter_config(lora, self.lora_targets, self.settings.path)
            peft_files.write(path, full, config)
        if self.layout.world_size > 1:
            dist.barrier()

    def load_adapter(self, path: Path) -> None:
        """Start from the adapter in a PEFT directory (its rank and alpha must be this run's;
        it must cover exactly this run's modules); every rank reads it."""
        lora = self._need_lora("load_adapter")
        adapter = peft_files.read(path, lora)
        want = self._lora_modules()
        if set(adapter) != set(want):
            extra, missing = sorted(set(adapter) - set(want)), sorted(set(want) - set(adapter))
            raise EngineConfigError(
                f"the adapter in {path} does not cover this run's modules (missing {missing[:3]}, extra {extra[:3]}); "
                "fix: set actor.lora.targetModules to the adapter's target_modules"
            )
        for module, (a, b) in adapter.items():
            n_in, n_out = want[module]
            if tuple(a.shape) != (lora.rank, n_in) or tuple(b.shape) != (n_out, lora.rank):
                raise EngineConfigError(
                    f"the adapter in {path} has {module} A {tuple(a.shape)} and B {tuple(b.shape)}, this model needs "
                    f"{(lora.rank, n_in)} and {(n_out, lora.rank)}; fix: use an adapter trained on this model"
                )
        self._lora_set(adapter)
        self._refresh_sampler()

    def _merged(
        self, hf: Mapping[str, torch.Tensor] | None, *, everywhere: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """``hf`` (full Hugging Face weights, None on ranks that hold none) with the adapter
        merged in when this engine has one; every rank calls it (the adapter's gather)."""
        if self.lora is None:
            return dict(hf) if hf is not None else None
        full = self._lora_full(everywhere=everywhere)
        if hf is None or full is None:
            return None
        return peft_files.merge(hf, full, self.lora.scale)
