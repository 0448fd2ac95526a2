"""CPU forward + backward time of one training step: tree-packed vs. the same sequences flat.

    python bench/train_step.py [--engines fsdp archon megatron] [--scale 0.0625] [--max-tokens 4096] [--repeat 3]

For each workload of ``bench/workloads.py`` (lengths multiplied by ``--scale`` so a CPU can
run it), one run packs the batch twice with the same packer and the same ``sparse``
attention backend: as trees (``share_prefixes=True``) and flat (``share_prefixes=False``:
every sequence alone, block-diagonal causal). A step is, per micro-batch: model forward,
chunked log-prob gather, loss = -sum(logp) / tokens, backward. Packing is not timed (see
bench/packing.py). Burn-in one step, then the best of ``--repeat`` measured steps, both in
wall time and in this process's CPU time (one torch thread: CPU time is the compute, without
the time other jobs on a shared machine took the core).

Printed next to the measured speedup (flat time / tree time) are two ideals:
``1 / tree_token_ratio`` and the FLOPs ratio, flat over tree, where
FLOPs = 6 * (per-token parameters) * tokens + 12 * layers * heads * head_dim * attended
query-key pairs (padding excluded, so padding and block waste count against the measured side).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from workloads import workloads

from treetrain.attention import TreeAttentionMeta, tree_forward, use_tree_attention
from treetrain.logprob import TreeTensors, gather_logprobs
from treetrain.tree import PackConfig, PackedBatch, pack


def tiny_llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
    )
    model = LlamaForCausalLM(config).float().train()
    use_tree_attention(model)
    return model


class ArchonAsHF(torch.nn.Module):
    """The Archon engine's model with the same weights, called like the Hugging Face one
    (``--engine archon``)."""

    def __init__(self, hf: LlamaForCausalLM) -> None:
        from treetrain.engines.archon.model import ModelArgs, Transformer
        from treetrain.engines.archon.model.hf import from_hf_state

        super().__init__()
        self.config = hf.config
        args = ModelArgs.from_hf(hf.config)
        self.net = Transformer(args)
        names = list(self.net.state_dict())
        self.net.load_state_dict(from_hf_state(names, hf.state_dict(), n_experts=0, tie_embeddings=args.tie_embeddings))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: object) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.net(input_ids[0], position_ids[0], kwargs["tree_attention"])[None])


class MegatronAsHF(torch.nn.Module):
    """The Megatron engine's model (megatron-core ``GPTModel`` with our tree core attention and
    tree RoPE, ``megatron:d1`` in this one process) with the same weights, called like the
    Hugging Face one (``--engine megatron``)."""

    def __init__(self, hf: LlamaForCausalLM) -> None:
        from treetrain.config.backends import check_training_backend
        from treetrain.engines.megatron import convert, init_megatron
        from treetrain.engines.megatron.model import TreeGPT

        super().__init__()
        self.config = hf.config
        layout = init_megatron(check_training_backend("megatron:d1"))
        self.net = TreeGPT(hf.config, role="actor", recompute=False, seed=0)
        read = convert.StateDictReader(hf.state_dict())
        shape = convert.shape_of(hf.config, layout)
        with torch.no_grad():
            for name, p in self.net.gpt.named_parameters():
                p.copy_(convert.load_tensor(name, 0, read, shape, tied=bool(hf.config.tie_word_embeddings)))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: object) -> object:
        from types import SimpleNamespace

        from treetrain.engines.megatron.model import TreeInput

        positions = position_ids[0]
        padding = torch.zeros_like(positions, dtype=torch.bool)  # read by MoE layers only
        tree = TreeInput(meta=kwargs["tree_attention"], positions_N=positions, padding_N=padding)  # type: ignore[arg-type]
        return SimpleNamespace(logits=self.net(input_ids[0], tree)[None])


def step(model: LlamaForCausalLM, batch: PackedBatch, block_size: int) -> None:
    model.zero_grad(set_to_none=True)
    total = batch.stats.original_tokens - batch.stats.num_sequences  # predicted tokens, counted before the loop
    for tree in batch.trees:
        tensors = TreeTensors.from_tree(tree, torch.device("cpu"))
        meta = TreeAttentionMeta.from_tree(tree, backend="sparse", block_size=block_size, device=torch.device("cpu"))
        with tree_forward():
            logits = model(
                input_ids=tensors.input_ids_N[None],
                position_ids=tensors.position_ids_N[None],
                use_cache=False,
                tree_attention=meta,
            ).logits
        logits = logits.view(logits.shape[-2], logits.shape[-1])
        logp, _ = gather_logprobs(logits, tensors.pred_M, tensors.label_M)
        (-logp.sum() / total).backward()


def flops(model: LlamaForCausalLM, batch: PackedBatch) -> float:
    cfg = model.config
    per_token = sum(
        p.numel()
        for n, p in model.named_parameters()
        if not n.endswith(("embed_tokens.weight", "tok_embeddings.weight", "word_embeddings.weight"))
    )
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    pairs = sum(t.attended_pairs() for t in batch.trees)
    tokens = batch.stats.tree_tokens
    return 6.0 * per_token * tokens + 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * pairs


def timed_step(model: LlamaForCausalLM, batch: PackedBatch, block_size: int, repeat: int) -> tuple[float, float]:
    """Best wall time and best process CPU time of ``repeat`` steps after a burn-in step."""
    step(model, batch, block_size)  # burn-in
    walls, cpus = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()  # CPU: every op has finished when step() returns
        step(model, batch, block_size)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=0.0625)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    parser.add_argument("--workloads", nargs="*", help="names from bench/workloads.py (default: all)")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=["fsdp"],
        help="whose models, side by side in this one run: transformers' (the FSDP engine's), Archon's, "
        "Megatron's (megatron-core); each gets the same weights",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = tiny_llama(args.vocab)
    models = {engine: ENGINES[engine](base).train() for engine in args.engines}
    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"config: scale={args.scale} max_tokens_per_mb={args.max_tokens} block_size={args.block_size} "
        f"repeat={args.repeat} torch_threads={torch.get_num_threads()} attention=sparse "
        f"engines={','.join(args.engines)} "
        f"model=llama(hidden 128, 2 layers, 4 heads, 2 kv heads, vocab {args.vocab}, {n_params / 1e6:.2f}M params) fp32"
    )
    header = (
        f"{'engine':<8} {'workload':<15} {'orig tok':>8} {'tree tok':>8} {'ratio':>6} {'mb flat/tree':>12} "
        f"{'flat s':>7} {'tree s':>7} {'speedup':>7} {'cpu-s flat':>10} {'cpu-s tree':>10} {'cpu speedup':>11} "
        f"{'1/ratio':>7} {'FLOPs x':>7} {'vs FLOPs (wall, cpu)':>20}"
    )
    print(header)
    chosen = workloads(args.scale)
    for name in args.workloads or list(chosen):
        seqs = [[t % args.vocab for t in s] for s in chosen[name]()]
        config = dict(max_tokens_per_mb=args.max_tokens, block_size=args.block_size)
        tree = pack(seqs, PackConfig(**config))
        flat = pack(seqs, PackConfig(**config, share_prefixes=False))
        ideal_flops = flops(base, flat) / flops(base, tree)
        for engine, model in models.items():  # engines interleaved per workload: the same machine load
            t_flat, c_flat = timed_step(model, flat, args.block_size, args.repeat)
            t_tree, c_tree = timed_step(model, tree, args.block_size, args.repeat)
            print(
                f"{engine:<8} {name:<15} {tree.stats.original_tokens:>8} {tree.stats.tree_tokens:>8} "
                f"{tree.stats.tree_token_ratio:>6.3f} {flat.stats.num_trees:>5}/{tree.stats.num_trees:<6} "
                f"{t_flat:>7.2f} {t_tree:>7.2f} {t_flat / t_tree:>6.2f}x "
                f"{c_flat:>10.2f} {c_tree:>10.2f} {c_flat / c_tree:>10.2f}x "
                f"{1 / tree.stats.tree_token_ratio:>6.2f}x {ideal_flops:>6.2f}x "
                f"{t_flat / t_tree / ideal_flops:>11.2f}, {c_flat / c_tree / ideal_flops:.2f}",
                flush=True,
            )


ENGINES: dict[str, Callable[[LlamaForCausalLM], torch.nn.Module]] = {
    "fsdp": lambda hf: hf,
    "archon": ArchonAsHF,
    "megatron": MegatronAsHF,
}


if __name__ == "__main__":
    main()
