"""The Archon model on a GPU: bf16 parity with transformers and training tokens/s per backend.

    python bench/archon_gpu.py [--device cuda] [--backends flex triton] [--tokens 32768] [--out RESULTS.md]

A small random Qwen3 (8 layers, hidden 1024, 16 heads, 8 kv heads), bf16, ``torch.compile``d
per block on CUDA (what the engine does). Parity: log-probs of a branching batch, tree-packed
through Archon in bf16, against each sequence alone through transformers in fp32 (max abs
difference, and the fp32 Archon tree as the exact baseline). Speed: forward + backward of one
``--tokens`` tree micro-batch (8 samples of a shared prompt), tokens/s and peak memory, tree
vs the same sequences flat (flat may not fit; then it says so).
"""

from __future__ import annotations

import argparse
import time

import torch


def build(device: torch.device, dtype: torch.dtype, compile_: bool) -> tuple[object, object]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from treetrain.engines.archon.model import ModelArgs, Transformer
    from treetrain.engines.archon.model.hf import from_hf_state

    config = AutoConfig.for_model(
        "qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=65536,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).to(device).eval()
    args = ModelArgs.from_hf(config)
    net = Transformer(args).to(device)
    net.load_state_dict(from_hf_state(list(net.state_dict()), hf.state_dict(), n_experts=0, tie_embeddings=False))
    net = net.to(dtype)
    if compile_:
        for block in net.layers.values():
            block.compile()
    return hf, net


def run_tree(
    net: object, seqs: list[list[int]], backend: str, max_tokens: int, device: torch.device
) -> list[torch.Tensor]:
    from treetrain.attention import TreeAttentionMeta
    from treetrain.logprob import TreeTensors, gather_logprobs
    from treetrain.tree import PackConfig, pack

    batch = pack(seqs, PackConfig(max_tokens_per_mb=max_tokens, block_size=128))
    per_tree = []
    for tree in batch.trees:
        t = TreeTensors.from_tree(tree, device)
        meta = TreeAttentionMeta.from_tree(tree, backend=backend, block_size=128, device=device)
        logits = net(t.input_ids_N, t.position_ids_N, meta)  # type: ignore[operator]
        logp, _ = gather_logprobs(logits, t.pred_M, t.label_M)
        per_tree.append(list(torch.split(logp, list(t.split_sizes))))
    return batch.unpack(per_tree)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backends", nargs="*", default=["flex", "triton"])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device(a.device)
    on_cuda = device.type == "cuda"
    lines = [f"## Archon model (Qwen3-style, 8 layers, hidden 1024), {'compiled, ' if on_cuda else ''}{a.device}"]
    hf, net = build(device, torch.bfloat16, compile_=on_cuda)
    _, net32 = build(device, torch.float32, compile_=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 32000, (300,), generator=g).tolist()
    seqs = [prompt + torch.randint(0, 32000, (int(n),), generator=g).tolist() for n in (0, 1, 129, 200, 257, 40)]
    seqs = [s for s in seqs if len(s) > 1]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(input_ids=torch.tensor(s, device=device)[None]).logits[0, :-1].float(), -1)  # type: ignore[operator]
               [torch.arange(len(s) - 1), torch.tensor(s[1:])] for s in seqs]  # fmt: skip
        exact = run_tree(net32, seqs, a.backends[0] if on_cuda else "sparse", 2048, device)
        lines.append(
            f"fp32 Archon tree vs transformers alone: max |dlogp| = {max((x - y).abs().max().item() for x, y in zip(exact, ref, strict=True)):.2e}"
        )
        for backend in a.backends:
            got = run_tree(net, seqs, backend, 2048, device)
            diff = max((x.float() - y).abs().max().item() for x, y in zip(got, ref, strict=True))
            lines.append(f"bf16 {backend} tree vs fp32 transformers alone: max |dlogp| = {diff:.3f}")
    # One micro-batch of --tokens tree tokens: 8 samples of a shared prompt.
    n_prompt = a.tokens // 2
    each = (a.tokens - n_prompt) // 8 - 16
    prompt = torch.randint(0, 32000, (n_prompt,), generator=g).tolist()
    seqs = [prompt + torch.randint(0, 32000, (each,), generator=g).tolist() for _ in range(8)]
    for backend in a.backends:
        for kind in ("tree", "flat"):
            from treetrain.attention import TreeAttentionMeta
            from treetrain.logprob import TreeTensors, gather_logprobs
            from treetrain.tree import PackConfig, pack

            flat = kind == "flat"
            cap = a.tokens if not flat else 8 * (n_prompt + each + 128)
            batch = pack(
                seqs, PackConfig(max_tokens_per_mb=-(-cap // 128) * 128, block_size=128, share_prefixes=not flat)
            )
            try:
                if on_cuda:
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for tree in batch.trees:
                    t = TreeTensors.from_tree(tree, device)
                    meta = TreeAttentionMeta.from_tree(tree, backend=backend, block_size=128, device=device)
                    logits = net(t.input_ids_N, t.position_ids_N, meta)  # type: ignore[operator]
                    logp, _ = gather_logprobs(logits, t.pred_M, t.label_M)
                    logp.sum().backward()
                if on_cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else float("nan")
                orig = batch.stats.original_tokens
                lines.append(f"{backend} {kind}: {batch.stats.tree_tokens} tokens in one micro-batch, "
                             f"{orig / dt:,.0f} original tokens/s, peak {peak:.1f} GiB")  # fmt: skip
            except torch.OutOfMemoryError:
                lines.append(f"{backend} {kind}: does not fit (out of memory)")
            net.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
