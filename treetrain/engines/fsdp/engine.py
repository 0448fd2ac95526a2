"""The FSDP engine: a Hugging Face model (:mod:`.model`) spread over the ranks
(:mod:`.parallelize`), trained with tree packing through transformers' attention registry.

Letters: N packed tokens of one micro-batch, V vocabulary, M gathered positions.

Every rank holds the whole batch (rollouts are broadcast) and packs it the same way; the
packer balances trees so that every data-parallel rank runs the same number of micro-batches
(FSDP's collectives need that), and tensor-parallel ranks of one data-parallel rank run the
same trees. The lifecycle (micro-batch loop, stats, step, checkpoints) is the core's
(:class:`~treetrain.engines.base.Engine`); this module builds the model and runs one tree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from treetrain.attention import TreeAttentionMeta, tree_forward
from treetrain.engines.base import Engine
from treetrain.engines.contract import MicroBatchOutput, MicroBatchRun
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.fsdp.layout import FSDPLayout, init_layout
from treetrain.engines.fsdp.model import build_parallel
from treetrain.engines.lora import Adapter
from treetrain.engines.lora.linear import is_adapter
from treetrain.engines.precision import torch_dtype
from treetrain.logprob import TreeTensors, gather_logprobs
from treetrain.tree import PackedTree


class FSDPEngine(Engine):
    """Actor (log-probs), critic (values) or reference (log-probs, frozen) on a Hugging Face
    model. ``optimizer=None``: forward only (the parameters do not require grad)."""

    layout: FSDPLayout
    init_layout = staticmethod(init_layout)

    def _build(self) -> None:
        lora = (self.lora, self.lora_targets) if self.lora is not None else None
        self.model: nn.Module = build_parallel(self.source, self.role, self.layout, self.precision, lora)

    # -- LoRA (treetrain/engines/lora/core.py) -----------------------------------------------
    def _lora_modules(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Linear) and hasattr(module, "lora_A"):
                n_out, n_in = module.weight.shape  # a DTensor's global shape
                out[name] = (int(n_in), int(n_out))
        return out

    def _lora_full(self, *, everywhere: bool, grads: bool = False) -> Adapter | None:
        full = {}
        for name, p in self.model.named_parameters():  # the same order on every rank
            if is_adapter(name):
                t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
                t = t.full_tensor() if isinstance(t, DTensor) else t
                full[name] = t.detach().cpu()
        if not (everywhere or self.layout.is_main):
            return None
        return {m: (full[f"{m}.lora_A.weight"], full[f"{m}.lora_B.weight"]) for m in self._lora_modules()}

    def _lora_set(self, adapter: Adapter) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        state: dict[str, Any] = {}
        for module, (a, b) in adapter.items():
            state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"] = a, b
        for unit in self.model.modules():  # the root stays gathered after a forward: shard it again first
            if isinstance(unit, FSDPModule):
                unit.reshard()
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def _optim_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # A LoRA checkpoint holds the adapter (and its optimizer state), not the frozen base.
        # (strict=False: the frozen base is not in it; the metadata's "lora" says it is this run's adapter.)
        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.lora is not None else None

    # -- one micro-batch -------------------------------------------------------------------
    def _run(self, tree: PackedTree, *, entropy: bool) -> MicroBatchRun:
        device = self.layout.device
        tensors = TreeTensors.from_tree(tree, device)
        meta = TreeAttentionMeta.from_tree(tree, backend=self.attention, block_size=self.block_size, device=device)
        with tree_forward():
            raw = self.model(
                input_ids=tensors.input_ids_N[None],
                position_ids=tensors.position_ids_N[None],
                use_cache=False,
                tree_attention=meta,
            )
        if self.role == "critic":
            values_N = raw[0]
            out = MicroBatchOutput(values=values_N[tensors.pred_M].float())
            anchor = values_N.sum() * 0.0
        else:
            logits = raw.logits
            logits_NV = logits.view(logits.shape[-2], logits.shape[-1])  # a view: no select-backward copy
            logp_M, ent_M = gather_logprobs(logits_NV, tensors.pred_M, tensors.label_M, with_entropy=entropy)
            out = MicroBatchOutput(logprobs=logp_M, entropy=ent_M)
            anchor = logits_NV[:1, :1].sum() * 0.0
        return MicroBatchRun(tree=tree, out=out, anchor=anchor)

    # -- Hugging Face weights --------------------------------------------------------------
    def export_hf(self, path: Path) -> None:
        """Full (unsharded) weights as safetensors + config, in ``model.dtype`` (the compute
        dtype, not the fp32 master weights); rank 0 writes, every rank joins."""
        state = self.hf_weights()
        if state is not None:
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(str(path), state_dict=state)  # type: ignore[operator]
            config_file = path / "config.json"
            config = json.loads(config_file.read_text())
            config["dtype"] = self.precision.compute  # what the weights are, not the masters'
            config.pop("torch_dtype", None)
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
        if self.layout.world_size > 1:
            dist.barrier()

    def hf_weights(self) -> dict[str, torch.Tensor] | None:
        """Full (unsharded) weights by Hugging Face name in ``model.dtype`` (what rollout servers
        load: fp32 master weights are cast, as Archon's export does), gathered to rank 0's CPU;
        every rank joins. With LoRA, the merged ``W + (alpha / r) B A``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.role == "critic":
            raise EngineConfigError("only an actor exports Hugging Face weights for rollout servers")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        base = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not is_adapter(k)}
        merged = self._merged(base if self.layout.is_main else None)  # LoRA: W + scale B A (a gather)
        if merged is None:
            return None
        dtype = torch_dtype(self.precision.compute)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients by parameter name (tests and parity scripts)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().cpu().clone()
        return out
