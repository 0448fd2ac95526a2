"""Tree attention backends on one device: correctness against `dense`, then speed.

    python bench/attention.py [--device cuda] [--dtype bfloat16] [--max-tokens 32768]
                              [--scale 1.0] [--heads 32] [--kv-heads 8] [--head-dim 128]
                              [--repeat 5] [--out RESULTS.md] [--smoke]

1. Check: every backend (sparse, flex, triton) against `dense` on a branching tree, forward
   and backward, in ``--dtype``; the reference is `dense` run in fp32 on the same inputs.
   Tolerances (stated in the table): outputs max-abs <= 2e-2 (bf16) / 1e-4 (fp32); each
   gradient's relative error ||g - g_ref|| / ||g_ref|| <= 2e-2 (bf16) / 1e-4 (fp32).
2. Speed: for each workload of ``bench/workloads.py``, pack the batch into trees and time
   attention forward+backward over all trees per backend, next to the baseline: plain
   causal attention (``scaled_dot_product_attention(is_causal=True)``, the fused flash
   kernel on CUDA) over every sequence alone, i.e. the same original tokens flat. Reported:
   original tokens/s, speedup over the baseline, and two ideals: the attention FLOPs ratio
   (attended query-key pairs, flat over tree) and ``1 / tree_token_ratio``.

Burn-in one pass, then the best of ``--repeat``; the device is synchronised before every
clock read. ``--smoke`` runs tiny shapes on any device (the unit tests use it).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import workloads

from treetrain.attention import BACKENDS, TreeAttentionMeta, resolve
from treetrain.tree import PackConfig, PackedTree, pack


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], None], device: torch.device, repeat: int) -> float:
    fn()  # burn-in (compilation, caches)
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _qkv(n: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(n)
    return [
        (torch.randn(h, n, args.head_dim, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_()
        for h in (args.heads, args.kv_heads, args.kv_heads)
    ]


def _backends(device: torch.device) -> list[str]:
    usable = []
    for name in ("sparse", "flex", "triton"):
        try:
            resolve(name, device, needs_grad=True)
        except ValueError as err:
            print(f"  skipping {name} on {device.type}: {err}")
            continue
        usable.append(name)
    return usable


def check(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, backends: list[str]) -> list[str]:
    """Rows of the correctness table."""
    seqs = workloads(scale=args.check_scale)["agentic_n8"]()
    tree = pack(seqs, PackConfig(max_tokens_per_mb=args.check_tokens, block_size=args.block_size)).trees[0]
    q, k, v = _qkv(tree.padded_len, args, device, dtype)
    scale = args.head_dim**-0.5
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    meta = TreeAttentionMeta.from_tree(tree, backend="dense", block_size=args.block_size, device=device)
    ref = BACKENDS["dense"](*ref_in, meta, scale)
    weights = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * weights).sum(), ref_in)
    out_tol, grad_tol = (2e-2, 2e-2) if dtype != torch.float32 else (1e-4, 1e-4)
    rows = [
        f"Correctness vs `dense` (fp32 reference), {tree.padded_len} tree tokens, {dtype}: "
        f"output max-abs <= {out_tol:g}, gradient relative error <= {grad_tol:g}",
        "",
        "| backend | output max-abs | dq rel | dk rel | dv rel | pass |",
        "|---|---|---|---|---|---|",
    ]
    for name in backends:
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        meta = TreeAttentionMeta.from_tree(tree, backend=name, block_size=args.block_size, device=device)
        out = BACKENDS[name](*inputs, meta, scale)
        grads = torch.autograd.grad((out.float() * weights).sum(), inputs)
        err = (out.float() - ref).abs().max().item()
        rel = [((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads, strict=True)]
        ok = err <= out_tol and max(rel) <= grad_tol
        rows.append(f"| {name} | {err:.2e} | {rel[0]:.2e} | {rel[1]:.2e} | {rel[2]:.2e} | {'yes' if ok else 'NO'} |")
    return rows


def _attended_pairs(tree: PackedTree) -> int:
    return sum(end - j for j, end in enumerate(tree.token_end[: tree.num_tokens]))


def speed(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, backends: list[str]) -> list[str]:
    rows = [
        f"Speed: attention forward+backward, {args.heads} heads / {args.kv_heads} KV heads x {args.head_dim}, "
        f"{dtype}, trees of {args.max_tokens} tokens, block {args.block_size}, best of {args.repeat}",
        "",
        "| workload | tree_token_ratio | backend | orig tokens/s | speedup vs causal flat | FLOPs ideal | 1/ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    scale = args.head_dim**-0.5
    for name, make in workloads(scale=args.scale).items():
        seqs = make()
        batch = pack(seqs, PackConfig(max_tokens_per_mb=args.max_tokens, block_size=args.block_size))
        original = batch.stats.original_tokens
        flat_pairs = sum(len(s) * (len(s) + 1) // 2 for s in seqs)
        tree_pairs = sum(_attended_pairs(t) for t in batch.trees)
        flat_inputs = [_qkv(len(s), args, device, dtype) for s in seqs]

        def causal_flat(flat_inputs: list[list[torch.Tensor]] = flat_inputs) -> None:
            for q, k, v in flat_inputs:
                out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
                out.sum().backward()

        baseline = _best(causal_flat, device, args.repeat)
        common = f"| {name} | {batch.stats.tree_token_ratio:.3f} "
        ideals = f"| {flat_pairs / tree_pairs:.2f} | {1 / batch.stats.tree_token_ratio:.2f} |"
        rows.append(f"{common}| causal flat (SDPA) | {original / baseline:,.0f} | 1.00 {ideals}")
        for backend in backends:
            trees = [
                (TreeAttentionMeta.from_tree(t, backend=backend, block_size=args.block_size, device=device),
                 _qkv(t.padded_len, args, device, dtype))
                for t in batch.trees
            ]  # fmt: skip

            def run(trees: list[tuple[TreeAttentionMeta, list[torch.Tensor]]] = trees, backend: str = backend) -> None:
                for meta, (q, k, v) in trees:
                    BACKENDS[backend](q, k, v, meta, scale).sum().backward()

            took = _best(run, device, args.repeat)
            rows.append(f"{common}| {backend} | {original / took:,.0f} | {baseline / took:.2f} {ideals}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--scale", type=float, default=1.0, help="workload length multiplier")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--check-scale", type=float, default=0.25)
    parser.add_argument("--check-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, help="write the tables to this Markdown file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device (for tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.block_size, args.scale, args.repeat = 512, 16, 0.01, 1
        args.heads, args.kv_heads, args.head_dim = 2, 1, 16
        args.check_scale, args.check_tokens = 0.01, 512
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = [f"# Tree attention on {name} ({datetime.date.today().isoformat()})", ""]
    header.append(f"torch {torch.__version__}; command: python bench/attention.py {' '.join(argv or sys.argv[1:])}")
    backends = _backends(device)
    tables = [*header, "", *check(args, device, dtype, backends), "", *speed(args, device, dtype, backends), ""]
    text = "\n".join(tables)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
