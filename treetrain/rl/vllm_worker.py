"""Our vLLM worker extension: the vLLM side of the weight sync, distributed and from disk.

vLLM mixes this class into its workers when started with ``--worker-extension-cls
treetrain.rl.vllm_worker.WeightSyncExtension``; the trainer calls its methods on every worker
through ``POST /collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``). Each worker joins the
trainer's weight-update group as ``rank_offset + its rank in the server`` and receives the
broadcast buckets with :mod:`treetrain.rl.weight_group`, the module the trainer sends with; a
disk sync loads a safetensors directory the same way. Imports torch, safetensors and that module
only: it runs inside the vLLM server's own environment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from treetrain.rl import weight_group as wg


class WeightSyncExtension:
    """Methods added to vLLM's workers (``self`` is the worker: ``model_runner``, ``device``, ``rank``)."""

    _weight_group: Any = None
    weight_version: int | None = None
    _tied: TiedWeights | None = None  # over the buckets of the version being loaded

    def join_weight_group(
        self,
        address: str,
        port: int | str,
        rank_offset: int | str,
        world_size: int | str,
        group_name: str = wg.GROUP_NAME,
        backend: str = "gloo",
        timeout_s: float | str = 600.0,
    ) -> int:
        """Join the trainer's group; returns this worker's rank in it."""
        if self._weight_group is not None:
            self.leave_weight_group()
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        self._weight_group = wg.join(
            address=address,
            port=int(port),
            rank=rank,
            world_size=int(world_size),
            group_name=group_name,
            backend=backend,
            timeout_s=float(timeout_s),
        )
        return rank

    def leave_weight_group(self) -> None:
        if self._weight_group is not None:
            wg.leave(self._weight_group)
            self._weight_group = None

    def receive_weights(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | str | None = None,
        first: bool = True,
        last: bool = True,
    ) -> int:
        """Receive one bucket and load it into the model (see :meth:`_load`); returns the bytes received."""
        if self._weight_group is None:
            raise RuntimeError("join_weight_group first: this worker is in no weight-update group")
        specs = [wg.TensorSpec(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        device = getattr(self, "device", "cpu")
        weights = wg.receive(self._weight_group, specs, "cpu" if str(device).startswith("cpu") else device)
        self._load(weights, first=first, last=last)
        if version is not None and last:
            self.weight_version = int(version)
        return sum(s.nbytes for s in specs)

    def load_weights_from_disk(self, weights_path: str, version: int | str | None = None) -> None:
        """Load a Hugging Face safetensors directory the way :meth:`receive_weights` loads a
        broadcast (the disk sync when the server has this extension; vLLM's own
        ``reload_weights`` leaves a tied ``lm_head`` stale, see :func:`with_tied`)."""
        self._load(safetensors_weights(Path(weights_path)), first=True, last=True)
        if version is not None:
            self.weight_version = int(version)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], *, first: bool, last: bool) -> None:
        """Load weights through vLLM's in-place reload, split over the buckets of a version: the
        first restores the checkpoint layout of the layers (the CPU backend, for one, repacks
        linear weights after loading), every bucket loads its tensors, the last processes the
        layers again. A worker without it (an older vLLM, our stand-in) loads them directly."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        try:
            from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]
            from vllm.model_executor.model_loader.reload.layerwise import (  # type: ignore[import-not-found]
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )
        except ImportError:
            runner.model.load_weights(weights=list(weights))
            return
        model, config = runner.get_model(), self.vllm_config  # type: ignore[attr-defined]
        if first or self._tied is None:  # before the reload gives tied modules tensors of their own
            self._tied = TiedWeights(tied_names(model))
        with set_current_vllm_config(config):
            if first:
                initialize_layerwise_reload(model)
            model.load_weights(with_tied(weights, self._tied, last=last))
            if last:
                finalize_layerwise_reload(model, config.model_config)
                self._tied = None
        if last:  # state derived from the old weights, dropped as vLLM's own reload_weights does
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                getattr(runner, reset, lambda: None)()

    def loaded_weight_version(self) -> int | None:
        """The version of the last weights loaded (None: the ones the server started with); a
        server that restarted answers None, so the trainer sends its weights again."""
        return self.weight_version


def tied_names(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """The parameter names that share one tensor, by group (tied word embeddings:
    ``model.embed_tokens.weight`` and ``lm_head.weight``)."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_tensor.values() if len(names) > 1]


@dataclass
class TiedWeights:
    """What :func:`with_tied` carries over the buckets of one version."""

    groups: list[tuple[str, ...]]  # from tied_names
    seen: set[str] = field(default_factory=set)  # every name loaded so far
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # the tensors loaded under tied names


def with_tied(
    weights: Iterable[tuple[str, torch.Tensor]], tied: TiedWeights, *, last: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, then (``last``) every tied name of a group that got a tensor under another name.

    vLLM's in-place reload gives each tied module its own placeholder, so a tied name missing
    from the weights (Hugging Face checkpoints store only the embedding) leaves its module
    unloaded; the reload then puts the old tensor back without processing the module again, and
    the CPU backend's ``lm_head`` keeps multiplying by its old packed copy (log-probs 0.03-0.3
    off). Loading the tied name too processes that module again, as the first load did."""
    names = {n for group in tied.groups for n in group}
    for name, t in weights:
        tied.seen.add(name)
        if name in names:
            tied.kept[name] = t
        yield name, t
    if last:
        for group in tied.groups:
            source = next((n for n in group if n in tied.kept), None)
            if source is not None:
                yield from ((n, tied.kept[source]) for n in group if n not in tied.seen)


def safetensors_weights(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face directory: the shards its index lists, else every
    ``*.safetensors`` file (as vLLM's own loader picks them)."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {root}")
    for f in files:
        with safe_open(str(root / f), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - a safetensors file is not a dict
                yield name, shard.get_tensor(name)
