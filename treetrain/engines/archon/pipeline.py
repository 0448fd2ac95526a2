"""Pipeline parallel for the Archon engine over the ``pp`` mesh dimension, on
``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B`` or ``ScheduleGPipe``).

Each stage owns a contiguous slice of the layers (the first also the embedding, the last the
final norm and the head), chosen by :func:`split_layers` from per-layer costs. Every rank
holds the whole batch and packs it the same way, so every stage builds each micro-batch's
tree metadata itself: it reaches the stage as keyword arguments (positions, the tree mask,
the padding mask), and only hidden states travel between stages. Pipelining needs one shape
per step, so a step's trees are padded to its largest (:func:`pad_tree`: padding tokens
attend only to themselves and are never gathered into the loss); the stage is rebuilt with
that step's shapes (static metadata: no inference pass). Training runs 1F1B by default
(stage ``s`` holds at most ``S - s`` micro-batches' activations; GPipe holds all ``M``); both
run the backwards in micro-batch order, so their gradients are identical.

Letters: L layers, S stages, M micro-batches, N padded tree tokens, n rows on one context
rank, d model width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from treetrain.alloc.memory import ModelShape, head_flops, layer_flops, split_min_max
from treetrain.engines.archon.layout import ArchonLayout
from treetrain.engines.archon.model import ModelArgs, Transformer
from treetrain.tree import pad_tree as pad_tree  # one padding for every engine; re-exported

# -- the layer split -------------------------------------------------------------------------


def _shape(args: ModelArgs) -> ModelShape:
    """The memory plan's view of ``args``: the FLOP model of the split lives there, once, so
    the plan predicts the stages the engine builds."""
    return ModelShape(
        family=args.family,
        vocab=args.vocab_size,
        hidden=args.dim,
        layers=args.n_layers,
        heads=args.n_heads,
        kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        ffn=args.ffn_dim,
        experts=args.n_experts,
        top_k=args.top_k,
        moe_ffn=args.moe_ffn_dim,
        moe_layers=tuple(args.moe_layers),
    )


def layer_costs(args: ModelArgs, tokens: int) -> list[float]:
    """Forward FLOPs of each layer on one tree of ``tokens`` tokens. Attention is counted at
    a full causal mask (an upper bound: a tree mask only removes pairs), so longer trees make
    the layers heavier relative to the head."""
    return layer_flops(_shape(args), tokens)


def head_cost(args: ModelArgs, tokens: int, *, value_head: bool) -> float:
    """Forward FLOPs of the last stage's extra work: the final norm and the head (the
    vocabulary projection and its log-softmax, or one value per token)."""
    return head_flops(_shape(args), tokens, value_head=value_head)


# The split itself is pure and shared with the memory plan (which must predict it exactly).
split_layers = split_min_max


def stage_layers(args: ModelArgs, stages: int, *, tokens: int, value_head: bool) -> list[range]:
    """The layer split of ``args`` over ``stages``, costed for trees of ``tokens`` tokens."""
    return split_layers(layer_costs(args, tokens), stages, last=head_cost(args, tokens, value_head=value_head))


def keep_stage(model: Transformer, layers: range, *, first: bool, last: bool) -> None:
    """Cut ``model`` (still on the meta device) down to one stage: its layers, the embedding
    on the first stage, the final norm and heads on the last."""
    for name in [k for k in model.layers if int(k) not in layers]:
        del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = model.value_head = None


# -- one step through the pipeline -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageShapes:
    """Per-step shapes of what crosses stages: the first stage's input ``[n]`` token ids, the
    hidden states ``[n, d]`` (``n / t`` rows under sequence parallel) and the last stage's
    output (``[n, V]`` logits or ``[n]`` values)."""

    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    output: tuple[int, ...]
    dtype: torch.dtype


def run_schedule(
    model: nn.Module,
    layout: ArchonLayout,
    shapes: StageShapes,
    inputs: Sequence[tuple[torch.Tensor, dict[str, Any]]],
    on_output: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    train: bool,
    schedule: Literal["1f1b", "gpipe"] = "1f1b",
) -> None:
    """Run every micro-batch through the pipeline: ``1f1b`` (one forward, one backward in
    steady state) or ``gpipe`` (all forwards, then all backwards). Forward only runs GPipe's
    order, and so does 1F1B with fewer micro-batches than stages (``Schedule1F1B`` refuses it).

    ``inputs[i]``: micro-batch ``i``'s token ids (read on the first stage) and keyword
    arguments (every stage). ``on_output(i, out)`` runs on the last stage and returns the
    scalar to backward, already scaled: the schedule does not divide it again
    (``scale_grads=False``)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage_id, stages, device = layout.pp_rank, layout.pp, layout.device
    first, last = stage_id == 0, stage_id == stages - 1
    # Static metadata (no inference pass): requires_grad on both sides tells each stage to
    # send and receive the gradients of the hidden states.
    if first:
        example_in: torch.Tensor = torch.zeros(shapes.tokens, dtype=torch.long, device=device)
    else:
        example_in = torch.zeros(shapes.hidden, dtype=shapes.dtype, device=device, requires_grad=True)
    out_shape = shapes.output if last else shapes.hidden
    example_out = torch.zeros(out_shape, dtype=shapes.dtype, device=device, requires_grad=True)
    stage = PipelineStage(
        model, stage_id, stages, device, input_args=example_in, output_args=example_out, group=layout.group_of("pp")
    )

    def loss_fn(out: torch.Tensor, index: int) -> torch.Tensor:
        if isinstance(out, DTensor):
            out = out.to_local()  # a replicated value head under tensor parallel
        return on_output(index, out)

    one_f_one_b = train and schedule == "1f1b" and len(inputs) >= stages
    runner = (Schedule1F1B if one_f_one_b else ScheduleGPipe)(stage, len(inputs), loss_fn=loss_fn, scale_grads=False)
    mbs: dict[str, Any] = {
        "kwarg_mbs": [kwargs for _, kwargs in inputs],
        "target_mbs": list(range(len(inputs))),
    }
    if first:
        mbs["arg_mbs"] = [(tokens,) for tokens, _ in inputs]
    if train:
        runner.step(return_outputs=False, **mbs)
    else:
        runner.eval(**mbs)


def exchange_tied_grad(param: torch.Tensor, layout: ArchonLayout) -> None:
    """Sum the tied embedding / head gradient between the first and last stage (the same
    weight, used at both ends): each sends its local piece and adds the other's (the pieces
    line up: both stages shard it alike over the same data x context and tensor ranks)."""
    group = layout.group_of("pp")
    peer = dist.get_global_rank(group, layout.pp - 1 if layout.pp_rank == 0 else 0)
    grad = param.grad
    if grad is None:  # no micro-batch ran: a zero gradient
        grad = param.grad = torch.zeros_like(param)
    if isinstance(grad, DTensor):
        assert isinstance(param, DTensor)
        if grad.placements != param.placements:
            # Tensor parallel leaves the embedding's gradient in another layout than the head's.
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        local = grad.to_local()
    else:
        local = grad
    theirs = torch.empty_like(local)
    ops = [dist.P2POp(dist.isend, local.contiguous(), peer), dist.P2POp(dist.irecv, theirs, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    local.add_(theirs)
