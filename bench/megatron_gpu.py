"""The Megatron engine on GPUs: parity with transformers, bf16 training tokens/s tree vs flat,
and the alltoall MoE token dispatcher.

    python bench/megatron_gpu.py [--tokens 16384] [--steps 3] [--out RESULTS.md]
    torchrun --nproc-per-node 2 bench/megatron_gpu.py ...     (megatron:t2, sequence parallel)

One process runs ``megatron:d1``; N processes run ``megatron:tN`` (tensor parallel with
sequence parallel). TransformerEngine layer specs are used when ``transformer_engine``
imports (the engine's choice on CUDA), Megatron's local spec otherwise; the output says which.

- dense: a random Qwen3 (8 layers, hidden 1024, 16 heads, 8 kv heads). Parity: log-probs of
  a branching batch, tree-packed, fp32 and bf16, against each sequence alone through
  transformers in fp32 (max abs difference). Speed: forward + backward of one ``--tokens`` tree
  (8 samples of a shared prompt) vs the same sequences flat, original tokens/s, peak memory.
- moe: a tiny Qwen3-MoE (8 experts, top 2). fp32 log-probs with the engine's ``allgather``
  dispatcher and with ``alltoall`` against transformers, and bf16 tokens/s of both.

Results: printed, appended to ``--out`` (markdown) and written to ``$OUT/megatron_gpu.json``
when ``OUT`` is set (rank 0). Needs CUDA: on a machine without it the script stops with that
message (the CPU paths are tested by ``tests/unit/test_megatron*.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DENSE = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 65536,
}  # fmt: skip
MOE = {
    "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 65536,
}  # fmt: skip
BLOCK = 128


def save(family: str, fields: dict[str, Any], root: Path) -> Path:
    """A random model written as a Hugging Face directory (the same weights on every rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / family
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def shared_prompt(n_prompt: int, each: int, count: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(8, vocab, (n_prompt,), generator=g).tolist()
    return [prompt + torch.randint(8, vocab, (each,), generator=g).tolist() for _ in range(count)]


def train_batch(seqs: list[list[int]], n_prompt: int) -> Any:
    from treetrain.engines.batch import TokenFields, TrainBatch

    masks = [(torch.arange(len(s) - 1) >= n_prompt - 1).float() for s in seqs]
    return TrainBatch(
        sequences=seqs,
        loss_mask=masks,
        fields=TokenFields(
            advantages=[torch.full((len(s) - 1,), 1.0 if i % 2 else -1.0) for i, s in enumerate(seqs)],
            old_logprobs=[torch.full((len(s) - 1,), -10.0) for s in seqs],
        ),
    )


@torch.no_grad()
def hf_logprobs(path: Path, seqs: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Each sequence alone through transformers, fp32, on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    for s in seqs:
        ids = torch.tensor(s, device=device)
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1)[torch.arange(len(s) - 1, device=device), ids[1:]].cpu())
    return out


def max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g.float() - w).abs().max()) for g, w in zip(got, want, strict=True))


def tokens_per_s(engine: Any, batch: Any, *, tree: bool, steps: int) -> dict[str, Any]:
    """Forward + backward of ``batch``: one burn-in step, then ``steps`` measured ones."""
    from treetrain.config import LossSettings
    from treetrain.rl.losses import PPOLoss

    loss = PPOLoss(LossSettings(clip_eps=0.2))
    try:
        engine.forward_backward(batch, loss, tree=tree)  # burn-in (and the flex compile)
        engine.zero_grad()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            stats = engine.forward_backward(batch, loss, tree=tree)
            engine.zero_grad()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
    except torch.OutOfMemoryError:
        engine.zero_grad()
        return {"tree": tree, "error": "out of memory"}
    return {
        "tree": tree,
        "original_tokens": stats.original_tokens,
        "trained_tokens": stats.tree_tokens,
        "micro_batches": stats.micro_batches,
        "tokens_per_s": stats.original_tokens / dt,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def engine_for(path: Path, backend: str, tokens: int, *, dtype: str, train: bool) -> Any:
    from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine

    tree = TreeTrainingSettings(max_tokens_per_mb=tokens, block_size=BLOCK, attention="flex")
    optimizer = OptimizerSettings() if train else None
    return build_engine(ModelSettings(path=str(path), dtype=dtype), backend, tree=tree, optimizer=optimizer)  # type: ignore[arg-type]


def dense(path: Path, backend: str, a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    seqs = [s[: 300 + n] for s, n in zip(shared_prompt(300, 257, 5, 32000, 1), (0, 1, 129, 257, 40), strict=True)]
    want = hf_logprobs(path, seqs, device)
    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        engine = engine_for(path, backend, 2048, dtype=dtype, train=dtype == "bfloat16")
        out[f"{dtype}_tree_max_abs_dlogp"] = max_diff(engine.forward(seqs), want)
    n_prompt = a.tokens // 2
    each = (a.tokens - n_prompt) // 8 - 16
    batch = train_batch(shared_prompt(n_prompt, each, 8, 32000, 3), n_prompt)
    speed = engine_for(path, backend, a.tokens, dtype="bfloat16", train=True)
    out["bf16_speed"] = [tokens_per_s(speed, batch, tree=t, steps=a.steps) for t in (True, False)]
    return out


def moe(path: Path, backend: str, a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from transformers import AutoConfig

    from treetrain.engines.megatron.model import TreeGPT, transformer_engine_available

    seqs = shared_prompt(200, 150, 4, 32000, 4)
    want = hf_logprobs(path, seqs, device)
    out: dict[str, Any] = {}
    hf = AutoConfig.from_pretrained(path)
    n_prompt = a.tokens // 2
    each = (a.tokens - n_prompt) // 8 - 16
    batch = train_batch(shared_prompt(n_prompt, each, 8, 32000, 5), n_prompt)
    for dtype in ("float32", "bfloat16"):
        engine = engine_for(path, backend, a.tokens, dtype=dtype, train=dtype == "bfloat16")
        for dispatcher in ("allgather", "alltoall"):
            if dispatcher != "allgather":  # the same weights behind Megatron's alltoall dispatcher
                swap = TreeGPT(hf, role="actor", recompute=False, seed=0, te=transformer_engine_available(),
                               dispatcher=dispatcher)  # fmt: skip
                swap.load_state_dict(engine.model.state_dict())
                engine.model = swap.to(device)
            if dtype == "float32":
                out[f"fp32_{dispatcher}_max_abs_dlogp"] = max_diff(engine.forward(seqs), want)
            else:
                out[f"bf16_{dispatcher}_speed"] = tokens_per_s(engine, batch, tree=True, steps=a.steps)
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return "; ".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def markdown(r: dict[str, Any]) -> str:
    lines = [f"## Megatron engine ({r['backend']}, {r['spec']} layer specs, {r['gpu']})", *r["notes"]]
    for name, part in (("dense Qwen3 (8 layers, hidden 1024)", r["dense"]), ("tiny Qwen3-MoE", r["moe"])):
        lines += [f"{name}:", *(f"- {k}: {_fmt(v)}" for k, v in part.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tree tokens of the speed micro-batch")
    p.add_argument("--steps", type=int, default=3, help="measured steps (after one burn-in step)")
    p.add_argument("--out", help="append the markdown results to this file")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/megatron_gpu.py needs CUDA: no CUDA device here (tests/unit/test_megatron*.py cover CPU)")
    from treetrain.engines.megatron.model import transformer_engine_available

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    backend = f"megatron:t{world}" if world > 1 else "megatron:d1"
    notes = []
    if world == 1:
        notes.append(
            f"{torch.cuda.device_count()} GPU(s) visible, one process: megatron:t2 needs 2 processes "
            "(torchrun --nproc-per-node 2), so this run is megatron:d1 (t1)"
        )
    results: dict[str, Any] = {
        "backend": backend,
        "gpu": torch.cuda.get_device_name(device),
        "spec": "TransformerEngine" if transformer_engine_available() else "local",
        "tokens": a.tokens,
        "steps": a.steps,
        "notes": notes,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results["dense"] = dense(save("qwen3", DENSE, root), backend, a, device)
        results["moe"] = moe(save("qwen3_moe", MOE, root), backend, a, device)
    if rank != 0:
        return
    text = markdown(results)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "megatron_gpu.json"
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
