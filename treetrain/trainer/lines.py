"""What the trainer prints: the run's first line, the step line (with its RL health part), the
``done:`` line, and the tree vs flat comparison's lines."""

from __future__ import annotations

from collections.abc import Sequence

from treetrain.alloc.precision import resolve_dtype
from treetrain.config import TrainConfig
from treetrain.engines.base import Engine
from treetrain.metrics import StepRecord
from treetrain.rl.rollout import RolloutClient
from treetrain.trainer.compare import Comparison
from treetrain.trainer.data import RunData


def header(cfg: TrainConfig, data: RunData, actor: Engine, client: RolloutClient | None) -> str:
    """The run's first line: what trains on what, the step's shape, the layout."""
    t, tree = cfg.trainer, cfg.actor.tree_training
    dtype = resolve_dtype(cfg.model.dtype, cuda=actor.layout.device.type == "cuda")
    dtype += ", recompute" if cfg.model.gradient_checkpointing else ""
    return (
        f"training {cfg.model.path} on {data.describe()}: {t.steps} steps, "
        f"{t.groups_per_step} groups x {t.group_size} samples, up to {data.max_new_tokens} new tokens "
        f"per reply, {cfg.actor.backend} ({dtype}), tree packing "
        f"{'on' if tree.enabled else 'off'} (max {tree.max_tokens_per_mb} tokens/micro-batch, attention "
        f"{actor.attention}), rollout {client.kind if client else 'remote'}"
    )


def format_record(rec: StepRecord, total: int) -> str:
    width = len(str(total))
    st = rec.stats
    return (
        f"step {rec.step:>{width}}/{total} | reward {rec.reward:.3f} | loss {rec.loss:+.4f} | {health_parts(rec)} | "
        f"tree_token_ratio {rec.tree_token_ratio:.3f} | train {rec.train_tokens_per_second:,.0f} tokens/s | "
        f"step {rec.seconds:.2f}s (rollout {rec.rollout_seconds:.2f}s, train {rec.train_seconds:.2f}s)"
        + (
            f" | logprob mismatch {st['behav_mismatch']:.2e} (max {st['behav_mismatch_max']:.2e})"
            if "behav_mismatch_max" in st
            else ""
        )
        + (
            f" | episodes capped: {st['episodes_capped_turns']:.0f} at trainer.maxTurns, "
            f"{st['episodes_capped_tokens']:.0f} at trainer.maxEpisodeTokens"
            if "episodes_capped_turns" in st
            else ""
        )
        + (
            f" | staleness max {st['staleness_max']:.0f} mean {st['staleness_mean']:.2f}"
            if "staleness_max" in st
            else ""
        )
        + (f" | eval reward {st['eval_reward']:.3f}" if "eval_reward" in st else "")
    )


def health_parts(rec: StepRecord) -> str:
    """The step line's RL health, e.g. ``ent 1.23 kl 0.00104 clip 0.02 ratio 1.00/1.31 gnorm 0.84 |
    len 41/64 | no-signal 3/8 groups``: the policy's entropy, KL to the reference (with one),
    clipped share, importance ratio mean/max, gradient norm; reply length mean/max in tokens; the
    groups whose rewards were all equal. The last part is always there: a reward that stays 0
    shows as every group without a signal."""
    st = rec.stats
    policy = [f"ent {st['entropy']:.3g}"] if "entropy" in st else []
    policy += [f"kl {st['kl']:.3g}"] if "kl" in st else []
    policy += [f"clip {st['clip_fraction']:.3g}"] if "clip_fraction" in st else []
    policy += [f"ratio {st['ratio']:.2f}/{st['ratio_max']:.2f}"] if "ratio_max" in st else []
    policy.append(f"gnorm {rec.grad_norm:.3g}")
    parts = [" ".join(policy)]
    lengths = rec.response_lengths
    if lengths:
        parts.append(f"len {sum(lengths) / len(lengths):.0f}/{max(lengths)}")
    dropped = f", {rec.dropped_filtered} dropped" if rec.dropped_filtered else ""
    parts.append(f"no-signal {rec.zero_signal_groups}/{rec.groups} groups{dropped}")
    return " | ".join(parts)


def format_summary(records: Sequence[StepRecord], seconds: float) -> list[str]:
    """The ``done:`` line, printed as soon as the last step is trained."""
    if not records:
        return []
    last = records[-1]
    return [
        f"done: {len(records)} steps in {seconds:.1f}s; last step reward {last.reward:.3f}, "
        f"tree_token_ratio {last.tree_token_ratio:.3f}"
    ]


def format_comparison(c: Comparison) -> list[str]:
    which = "the last batch" if c.batches == 1 else f"the last {c.batches} batches"
    return [
        f"tree_token_ratio {c.tree_token_ratio:.3f} over {which} ({1 / c.tree_token_ratio:.2f}x fewer tokens)",
        f"speedup tree vs flat on {which} (forward+backward): {c.speedup:.2f}x "
        f"(flat {c.flat_seconds:.2f}s, tree {c.tree_seconds:.2f}s)",
    ]
