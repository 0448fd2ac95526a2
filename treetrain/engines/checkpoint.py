"""Checkpoint I/O of the engine core: ``save`` / ``load`` of the step count, every RNG state
and the caller's ``extra`` around each engine's own files (``_write`` / ``_read``; the default
is torch.distributed.checkpoint, shards per rank). A torn checkpoint raises
``CheckpointUnreadableError`` on every rank; one of another model or engine an
``EngineConfigError`` with the fix."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from treetrain.engines import checkpoint_files as files
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.sampler import LocalSampler


class Checkpoints(LocalSampler):
    """``save`` and ``load``; an engine's hooks: :meth:`_write`, :meth:`_read`,
    :meth:`_optim_options`."""

    def save(self, path: Path, extra: Mapping[str, Any]) -> None:
        """A resumable checkpoint: model, optimizer, step count, every RNG state and ``extra``
        (each engine's files: :meth:`_write`)."""
        path.mkdir(parents=True, exist_ok=True)
        meta = {
            "steps": self.steps,
            "rng": files.rng_state(),
            "extra": dict(extra),
            "model": self.settings.path,
            "engine": self.engine_name,
            "lora": self.lora_summary(),
        }
        self._write(path, meta)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; returns its ``extra``. A torn or empty checkpoint
        raises :class:`CheckpointUnreadableError` on every rank (the trainer then tries an
        older one); one of another model, engine or layout an ``EngineConfigError``."""
        meta = self._read(path)
        files.restore_rng(meta)
        self.steps = int(meta["steps"])
        self._refresh_sampler()
        extra: dict[str, Any] = dict(meta["extra"])
        return extra

    def _same_run(self, meta: Mapping[str, Any], path: Path) -> None:
        """Refuse a checkpoint of another model or engine, with the fix."""
        model = meta.get("model_path", meta.get("model", self.settings.path))  # Megatron: model_path
        engine = meta.get("engine", self.engine_name)  # older checkpoints name none
        if model != self.settings.path or engine != self.engine_name:
            raise EngineConfigError(
                f"checkpoint {path} was written for model {model!r} by the {engine} engine, but this run trains "
                f"{self.settings.path!r} with {self.engine_name}; fix: give this run a new checkpoint.dir "
                "(or restore the old settings)"
            )
        lora, mine = meta.get("lora"), self.lora_summary()
        if lora != mine:
            raise EngineConfigError(
                f"checkpoint {path} trained {_trained(lora)}, but this run trains {_trained(mine)}; fix: give this run "
                "a new checkpoint.dir (or restore actor.lora)"
            )

    def _dcp_state(self) -> dict[str, Any]:
        """This rank's model (and optimizer) state for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._optim_options())
        return {"model": model_sd, "optim": optim_sd}

    def _optim_options(self) -> Any:
        """``get_state_dict`` / ``set_state_dict`` options of the optimizer state (None: the defaults)."""
        return None

    def _write(self, path: Path, meta: dict[str, Any]) -> None:
        """DCP engines: every rank writes its shards (one process: ``torch.save``) and its own
        metadata file."""
        if self.layout.world_size > 1:
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

            dcp_save(self._dcp_state(), checkpoint_id=str(path / self.role))
        else:
            torch.save(self._dcp_state(), path / f"{self.role}.pt")  # one process: no collectives to plan
        torch.save(meta, path / f"{self.role}-rank{self.layout.rank}.pt")

    def _read(self, path: Path) -> dict[str, Any]:
        """DCP engines: load the state in place; returns this rank's checked metadata."""
        return files.load_sharded(
            path,
            self.role,
            self.layout.rank,
            self.layout.world_size,
            same_run=lambda meta: self._same_run(meta, path),
            model=self.model,
            optimizer=self.optimizer,
            empty=self._dcp_state,
            optim_options=self._optim_options(),
        )


def _trained(lora: Mapping[str, Any] | None) -> str:
    if lora is None:
        return "every weight"
    return f"a LoRA adapter of rank {lora['rank']} (alpha {lora['alpha']}) on {', '.join(lora['targets'])}"
