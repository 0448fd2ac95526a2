"""Shared helpers for the tree tests: reference masks from first principles, tiny HF models."""

from __future__ import annotations

from typing import Any

from treetrain.tree import PackConfig, PackedTree, pack


def one_tree(seqs: list[list[int]], block: int) -> PackedTree:
    """Pack ``seqs`` into exactly one tree, the cap rounded up to the block size."""
    cap = -(-sum(map(len, seqs)) // block) * block
    (tree,) = pack(seqs, PackConfig(max_tokens_per_mb=cap, block_size=block)).trees
    return tree


def token_parents(tree: PackedTree) -> list[int]:
    """Parent token of each real token, from the node metadata alone (-1 for roots)."""
    parents = []
    for t in range(tree.num_tokens):
        n = tree.token_node[t]
        if t > tree.node_start[n]:
            parents.append(t - 1)
        else:
            p = tree.node_parent[n]
            parents.append(tree.node_end[p] - 1 if p >= 0 else -1)
    return parents


def reference_mask(tree: PackedTree) -> list[list[bool]]:
    """allowed[i][j]: j is i or an ancestor of i (padding tokens see only themselves)."""
    n = tree.padded_len
    parents = token_parents(tree)
    allowed = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i][j] = True
            j = parents[j] if j < tree.num_tokens else -1
    return allowed


def tiny_model(family: str, seed: int = 0) -> Any:
    """A tiny random causal LM of ``family`` (llama, qwen2, qwen3), fp32, eval mode."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common: dict[str, Any] = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attention_dropout=0.0,
    )
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    }
    config_cls, model_cls, extra = classes[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra)).float().eval()
    model.set_attn_implementation("sdpa")
    return model
