"""One mapping from a checked :class:`Allocation` to megatron-core's ``parallel_state``.

``megatron:d2p2t2c2`` -> ``initialize_model_parallel(tp=2, pp=2, cp=2)`` (dp is what is left);
a hybrid ``megatron:(attn:d4t2|ffn:d2t2e2)`` -> attention tp from the attn section, expert
parallel ``e`` and expert tensor parallel (the ffn ``t``) from the ffn section. Megatron's
parallel state is process-global: one process runs one Megatron layout, and a second engine
with another megatron string in the same processes is refused (same string: shared).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from treetrain.alloc import Allocation
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.layout import Dim, Layout, join, one_process_group


@dataclass(frozen=True, slots=True)
class MegatronLayout(Layout):
    """This process's place in Megatron's grid, implementing the engines' layout protocol over
    megatron-core's ``parallel_state`` (process-global: :func:`init_megatron` builds it once).
    Its groups exist at every size (a one-rank context group at ``c1``); :meth:`group` answers
    None there like every layout, :meth:`group_of` gives Megatron's own (its optimizer's
    buckets and the gradient sums take them)."""

    def _rank_in(self, dim: Dim) -> int:
        from megatron.core import parallel_state as ps

        rank: Callable[[], int] = {
            "tp": ps.get_tensor_model_parallel_rank,
            "pp": ps.get_pipeline_model_parallel_rank,
            "cp": ps.get_context_parallel_rank,
            "dp": ps.get_data_parallel_rank,
            "dp_cp": lambda: ps.get_data_parallel_rank(with_context_parallel=True),
            "ep": ps.get_expert_model_parallel_rank,
            "etp": ps.get_expert_tensor_parallel_rank,
            "edp": ps.get_expert_data_parallel_rank,
        }[dim]
        return int(rank())

    def _group(self, dim: Dim) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        group: Callable[[], dist.ProcessGroup] = {
            "tp": ps.get_tensor_model_parallel_group,
            "pp": ps.get_pipeline_model_parallel_group,
            "cp": ps.get_context_parallel_group,
            "dp": ps.get_data_parallel_group,
            "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
            "ep": ps.get_expert_model_parallel_group,
            "etp": ps.get_expert_tensor_parallel_group,
            "edp": ps.get_expert_data_parallel_group,
        }[dim]
        return group()


def megatron_sizes(allocation: Allocation) -> dict[str, int]:
    """The keyword arguments of ``initialize_model_parallel`` for ``allocation`` (pure)."""
    d = allocation.dims
    return {
        "tensor_model_parallel_size": d.tp,
        "pipeline_model_parallel_size": d.pp,
        "context_parallel_size": d.cp,
        "expert_model_parallel_size": d.ep,
        "expert_tensor_parallel_size": d.etp,
    }


_CURRENT: dict[str, Any] = {}  # the allocation parallel_state was built for, and its layout


def init_megatron(allocation: Allocation, *, timeout_s: float = 1800.0) -> MegatronLayout:
    """Join the process group (one process gets a private one: megatron-core always needs
    one) and initialise Megatron's groups for ``allocation``, once per process."""
    from megatron.core import parallel_state as ps

    device, world = join(allocation, timeout_s=timeout_s)
    one_process_group(device)  # a no-op under torchrun
    if ps.model_parallel_is_initialized():
        if _CURRENT.get("group") is dist.group.WORLD and _CURRENT.get("allocation") == allocation:
            layout: MegatronLayout = _CURRENT["layout"]
            return layout
        if _CURRENT.get("group") is dist.group.WORLD:
            raise EngineConfigError(
                f"these processes already run {str(_CURRENT['allocation'])!r}; megatron-core keeps one parallel "
                f"layout per process, so {str(allocation)!r} cannot join it: give every megatron role the same backend"
            )
        ps.destroy_model_parallel()  # left over from a destroyed default group (tests)
    ps.initialize_model_parallel(**megatron_sizes(allocation), create_gloo_process_groups=False)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        cpu_adapter()
    layout = MegatronLayout(allocation=allocation, world_size=world, rank=dist.get_rank(), device=device)
    _CURRENT.update(group=dist.group.WORLD, allocation=allocation, layout=layout)
    return layout


def cpu_adapter() -> None:
    """Let megatron-core 0.16.1 run in a CPU-only process (gloo), as `treetrain train` does there:
    - sequence parallel's all-gather and reduce-scatter (``tensor_parallel/mappings.py``,
      ``layers.py``) and the MoE router (its weights) go to ``torch.cuda.current_device()``, which
      raises without a CUDA driver: it is pointed at the CPU;
    - the embedding forks the CUDA RNG tracker around its dropout: no RNG is needed here, every
      dropout rate is 0 (``model.transformer_config``);
    - ``moe_utils`` names ``te_general_gemm`` only when TransformerEngine imports: it is set to
      None, the value megatron-core checks for, so the MoE path takes its torch route."""
    import contextlib

    import torch
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name="": contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def reset_megatron() -> None:
    """Forget Megatron's parallel state (a process that switches layouts: tests, scripts)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _CURRENT.clear()
