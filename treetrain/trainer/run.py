"""What ``treetrain train`` runs: a trainer built, run and closed, then (``trainer.compareFlat``)
the last batches timed tree vs flat, each line printed as soon as it is known."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from treetrain.config import Launch, TrainConfig
from treetrain.trainer.lines import format_comparison, format_summary
from treetrain.trainer.loop import Summary, Trainer


def run_training(
    cfg: TrainConfig,
    *,
    launch: Launch | None = None,
    resume: bool = False,
    out: Any = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> Summary:
    """Build, run and close a trainer, then (``trainer.compareFlat``) time tree vs flat:
    what ``treetrain train`` calls. ``on_error`` sees an error of the run before the trainer is
    closed (the CLI prints its one line then: closing down can take seconds)."""
    stream = out or sys.stdout
    trainer = Trainer(cfg, launch=launch, resume=resume, log=lambda line: print(line, file=stream, flush=True))
    try:
        summary = trainer.run()
        for line in format_summary(summary.records, summary.seconds):
            trainer.log(line)
        if cfg.trainer.compare_flat and trainer.batches and not summary.interrupted:
            n, rounds = len(trainer.batches), cfg.trainer.compare_rounds
            kept = " and saved" if trainer.checkpoints.root is not None else ""
            trainer.log(
                f"timing tree vs flat packing on the last {n} batch{'es' if n > 1 else ''} "
                f"({rounds} round{'s' if rounds > 1 else ''}; training is done{kept}: --no-compare or "
                "trainer.compareFlat: false skips this, SIGTERM stops it)"
            )
            summary.comparison = trainer.compare()
            if summary.comparison is None:
                trainer.log("comparison skipped (SIGTERM)")
            for line in format_comparison(summary.comparison) if summary.comparison else []:
                trainer.log(line)
        return summary
    except BaseException as err:
        if on_error is not None:
            on_error(err)
        raise
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
