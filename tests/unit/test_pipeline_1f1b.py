"""1F1B against GPipe in both pipeline engines. Pure: the order of forwards and backwards on
each stage (every micro-batch once, a backward after its forward, backwards in micro-batch
order, at most ``S - s`` micro-batches in flight on stage ``s``) and that the stages, with
non-blocking sends and blocking receives, always finish; ``model.pipelineSchedule`` parses
and refuses unknown orders. Then ``archon:p2`` and ``megatron:p2`` on 2 CPU processes over
gloo, one engine each switched between the two schedules: six tree-packed branching
micro-batches (of two sizes: Megatron exchanges each one's own shape) give identical loss,
stats and gradients on every stage, and the bytes of activations saved for the backward at
the peak (``bench/tree_memory.py``'s ``SavedBytes``) are lower under 1F1B on every stage."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import spawn_ranks
from megatron_models import branching_sequences, make_batch, save_model

from treetrain.engines.megatron.schedule import Action, Schedule, order

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from tree_memory import SavedBytes

# -- the order (pure) ------------------------------------------------------------------------

SHAPES = [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


def _in_flight(actions: list[Action]) -> int:
    live = most = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


@pytest.mark.parametrize(("stages", "micro"), SHAPES)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_order_runs_each_micro_batch_once_backwards_in_order(schedule: Schedule, stages: int, micro: int) -> None:
    for stage in range(stages):
        actions = order(schedule, stages=stages, stage=stage, micro_batches=micro)
        fwd = [i for k, i in actions if k == "F"]
        bwd = [i for k, i in actions if k == "B"]
        assert fwd == bwd == list(range(micro))  # the same accumulation order in both schedules
        assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(micro))
        want = min(stages - stage, micro) if schedule == "1f1b" else micro
        assert _in_flight(actions) == want, (stage, actions)
    assert order(schedule, stages=stages, stage=0, micro_batches=micro, train=False) == [("F", i) for i in range(micro)]


@pytest.mark.parametrize(("stages", "micro"), SHAPES)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_stages_never_wait_on_each_other(schedule: Schedule, stages: int, micro: int) -> None:
    # Sends never block; a forward waits for the previous stage's forward of that micro-batch,
    # a backward for the next stage's backward of it. Run whichever stage can move: all finish.
    programs = [order(schedule, stages=stages, stage=s, micro_batches=micro) for s in range(stages)]
    done: set[tuple[int, str, int]] = set()
    pc = [0] * stages
    while any(pc[s] < len(programs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            if pc[s] == len(programs[s]):
                continue
            kind, i = programs[s][pc[s]]
            need = (s - 1, "F", i) if kind == "F" and s > 0 else (s + 1, "B", i) if kind == "B" else None
            if need is not None and need[0] < stages and need not in done:
                continue
            done.add((s, kind, i))
            pc[s] += 1
            moved = True
        assert moved, f"deadlock at {pc}"


def test_the_schedule_setting() -> None:
    from pydantic import ValidationError

    from treetrain.config import ModelSettings

    assert ModelSettings(path="m").pipeline_schedule == "1f1b"
    assert ModelSettings.model_validate({"path": "m", "pipelineSchedule": "gpipe"}).pipeline_schedule == "gpipe"
    with pytest.raises(ValidationError, match="pipelineSchedule"):
        ModelSettings.model_validate({"path": "m", "pipelineSchedule": "interleaved"})


# -- p2 on 2 processes -----------------------------------------------------------------------

TREE = {"max_tokens_per_mb": 64, "block_size": 16}


def _compare(backend: str, root: Path) -> dict[str, int]:
    """Both schedules through one engine: results identical; the saved-activation peaks."""
    import torch.distributed as dist

    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.engines.megatron.parallel import reset_megatron
    from treetrain.rl.losses import PPOLoss

    reset_megatron()
    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(branching_sequences() + branching_sequences(seed=1) + branching_sequences(seed=2))
    engine = build_engine(
        ModelSettings(path=str(root / "llama")),
        backend,
        tree=TreeTrainingSettings(**TREE),
        optimizer=OptimizerSettings(lr=1e-3),
    )
    sizes = sorted({t.padded_len for t in engine.pack(batch.sequences).trees})
    assert len(sizes) > 1, sizes
    got: dict[str, Any] = {}
    peaks: dict[str, int] = {}
    for schedule in ("gpipe", "1f1b"):
        engine.settings = engine.settings.model_copy(update={"pipeline_schedule": schedule})
        with SavedBytes(exclude=engine.model.parameters()) as meter:
            stats = engine.forward_backward(batch, loss)
        assert meter.now == 0, (backend, schedule, meter.now)  # every saved tensor was used and freed
        got[schedule] = (stats, engine.full_grads())
        peaks[schedule] = meter.peak
        engine.zero_grad()
    (a, ga), (b, gb) = got["gpipe"], got["1f1b"]
    assert a.micro_batches >= 4, a.micro_batches  # at least 2 x stages
    assert a == b, (backend, a, b)
    assert ga.keys() == gb.keys() and ga, backend
    for name, g in ga.items():
        assert torch.equal(g, gb[name]), (backend, name)
    stage = dist.get_rank()
    assert peaks["1f1b"] < peaks["gpipe"], (backend, stage, peaks)
    return peaks


def _checks(root: str) -> None:
    for backend in ("archon:p2", "megatron:p2"):
        peaks = _compare(backend, Path(root))
        print(f"{backend} stage {torch.distributed.get_rank()}: saved activations at the peak {peaks}", flush=True)


@pytest.mark.slow
def test_1f1b_equals_gpipe_with_a_lower_activation_peak(tmp_path: Path) -> None:
    save_model("llama", tmp_path)
    spawn_ranks(_checks, 2, str(tmp_path))
