"""Our vLLM worker extension: the vLLM side of the distributed weight sync.

vLLM mixes this class into its workers when started with ``--worker-extension-cls
treetrain.rl.vllm_worker.WeightSyncExtension``; the trainer calls its methods on every worker
through ``POST /collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``). Each worker joins the
trainer's weight-update group as ``rank_offset + its rank in the server`` and receives the
broadcast buckets with :mod:`treetrain.rl.weight_group`, the module the trainer sends with.
Imports torch and that module only: it runs inside the vLLM server's own environment.
"""

from __future__ import annotations

from typing import Any

from treetrain.rl import weight_group as wg


class WeightSyncExtension:
    """Methods added to vLLM's workers (``self`` is the worker: ``model_runner``, ``device``, ``rank``)."""

    _weight_group: Any = None
    weight_version: int | None = None

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
        """Receive one bucket and load it into the model; returns the bytes received.

        Loading goes through vLLM's in-place reload, split over the buckets of a version: the
        first restores the checkpoint layout of the layers (the CPU backend, for one, repacks
        linear weights after loading), every bucket loads its tensors, the last processes the
        layers again. A worker without it (an older vLLM, our stand-in) loads them directly."""
        if self._weight_group is None:
            raise RuntimeError("join_weight_group first: this worker is in no weight-update group")
        specs = [wg.TensorSpec(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        device = getattr(self, "device", "cpu")
        weights = wg.receive(self._weight_group, specs, "cpu" if str(device).startswith("cpu") else device)
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        try:
            from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]
            from vllm.model_executor.model_loader.reload.layerwise import (  # type: ignore[import-not-found]
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )
        except ImportError:
            runner.model.load_weights(weights=weights)
        else:
            model, config = runner.get_model(), self.vllm_config  # type: ignore[attr-defined]
            with set_current_vllm_config(config):
                if first:
                    initialize_layerwise_reload(model)
                model.load_weights(weights)
                if last:
                    finalize_layerwise_reload(model, config.model_config)
        if version is not None and last:
            self.weight_version = int(version)
        return sum(s.nbytes for s in specs)

    def loaded_weight_version(self) -> int | None:
        """The version of the last weights loaded (None: the ones the server started with); a
        server that restarted answers None, so the trainer sends its weights again."""
        return self.weight_version

    def set_weight_version(self, version: int | str) -> None:
        """Record the version of weights loaded another way (vLLM's own ``reload_weights``)."""
        self.weight_version = int(version)
