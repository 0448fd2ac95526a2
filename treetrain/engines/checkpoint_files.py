"""Reading an engine's checkpoint files, the same way for every engine: one place decides what
is *unreadable* (torn by a crash or a full disk: the trainer falls back to an older checkpoint)
and what is *foreign* (a file of another shape: a one-line error naming it and the fix).

- Unreadable (:class:`CheckpointUnreadableError`): a file ``torch.load`` cannot read (truncated,
  garbage, empty), a step directory with no files at all, a file holding an empty dict or empty
  model/optimizer state.
- Foreign (:class:`EngineConfigError`): a file that loads but is not what an engine writes (a
  list, a dict without ``steps``, an RNG state this process cannot take).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from treetrain.engines.errors import CheckpointUnreadableError, EngineConfigError


def first_line(err: BaseException) -> str:
    """An exception's first line (its type's name when it has no message)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _foreign(file: Path, problem: str) -> EngineConfigError:
    return EngineConfigError(
        f"{file} is not a checkpoint file this trainer writes ({problem}); fix: move {file.parent} out of "
        "checkpoint.dir (the trainer then resumes from the one before) or give this run a new checkpoint.dir"
    )


def own_file(path: Path, name: str, written_by: str) -> Path:
    """This rank's file ``name`` of the checkpoint ``path``. A directory with no files at all
    (a save that never wrote anything) is unreadable; one that holds other files but not this
    one was written by another layout (``written_by`` says which) and is refused."""
    own = path / name
    if own.is_file():
        return own
    if not any(p.is_file() for p in path.rglob("*")):
        raise CheckpointUnreadableError(f"{path} is empty (no checkpoint files)")
    raise FileNotFoundError(f"{own} is missing: checkpoint {path} was written by {written_by}")


def read(file: Path, *, map_location: Any = None) -> dict[str, Any]:
    """``torch.load`` of one checkpoint file, which must hold a non-empty dict: a file that
    cannot be read, or holds ``{}``, is unreadable; anything but a dict is foreign."""
    try:
        data = torch.load(file, weights_only=False, map_location=map_location)
    except Exception as err:  # torch.load fails in many types (zip, pickle, EOF, decode): all mean torn
        reason = first_line(err).split(". ")[0]  # torch's zip errors go on for three sentences
        raise CheckpointUnreadableError(f"{file} cannot be read ({reason})") from None
    if isinstance(data, dict) and not data:
        raise CheckpointUnreadableError(f"{file} holds an empty dict")
    if not isinstance(data, dict):
        raise _foreign(file, f"it holds a {type(data).__name__}, not a dict")
    return data


def check_state(state: Mapping[str, Any], file: Path, *, optimizer: bool) -> None:
    """Model (and, for a trained engine, optimizer) state that is missing or empty: unreadable."""
    for key in ("model", "optim") if optimizer else ("model",):
        value = state.get(key)
        if not isinstance(value, Mapping) or not value:
            raise CheckpointUnreadableError(f"{file} holds no {key} state")


def check_meta(meta: Mapping[str, Any], file: Path) -> None:
    """``steps``, ``extra`` and an RNG state this process can restore, checked before anything
    is loaded (a foreign value names the file and the key)."""
    steps = meta.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise _foreign(file, f"'steps' must be an integer >= 0, got {steps!r}")
    if not isinstance(meta.get("extra"), Mapping):
        raise _foreign(file, "it has no 'extra' dict")
    rng = meta.get("rng")
    if not isinstance(rng, Mapping):
        raise _foreign(file, "it has no 'rng' state")
    try:
        random.Random().setstate(rng["python"])
    except (KeyError, TypeError, ValueError) as err:
        raise _foreign(file, f"bad Python RNG state: {first_line(err)}") from None
    tracker = rng.get("cuda_tracker", {})
    if not isinstance(tracker, Mapping):
        raise _foreign(file, "bad Megatron CUDA RNG tracker state: not a dict")
    states = [("torch", rng.get("torch"))] + [("cuda", s) for s in rng.get("cuda", [])]
    states += [(f"cuda_tracker {k}", s) for k, s in tracker.items()]
    for name, state in states:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise _foreign(file, f"bad {name} RNG state: {type(state).__name__}, not a uint8 tensor")
    try:
        torch.Generator().set_state(rng["torch"].cpu())
    except RuntimeError as err:
        raise _foreign(file, f"bad torch RNG state: {first_line(err)}") from None


def agree(problem: Exception | None, world_size: int) -> None:
    """Every rank raises the first rank's ``problem`` (None: no problem anywhere), before a
    collective read: a rank that found its own file torn or foreign must not leave the others
    waiting in that read for it. One all-gather; nothing with one process."""
    if world_size > 1:
        import torch.distributed as dist

        found: list[Any] = [None] * world_size
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p is not None), None)
    if problem is not None:
        raise problem


def _cuda() -> bool:
    """Whether this process has CUDA generators to save and restore."""
    return torch.cuda.is_available()


def _megatron_tracker() -> Any:
    """Megatron's CUDA RNG tracker (dropout streams of its parallel regions) when this process
    runs megatron-core on CUDA; None otherwise (nothing of it to save or restore)."""
    import sys

    if "megatron.core" not in sys.modules or not _cuda():
        return None
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def rng_state() -> dict[str, Any]:
    """Every RNG state of this process: Python's, torch's CPU one, each CUDA device's, and
    Megatron's CUDA tracker streams (when in use), for :func:`restore_rng`."""
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if _cuda() else [],
    }
    tracker = _megatron_tracker()
    if tracker is not None:
        rng["cuda_tracker"] = dict(tracker.get_states())
    return rng


def restore_rng(meta: Mapping[str, Any]) -> None:
    """Apply the RNG state :func:`check_meta` checked (CUDA states where this process has CUDA)."""
    rng = meta["rng"]
    random.setstate(rng["python"])
    # Generator states are CPU byte tensors, wherever the file was mapped to.
    torch.set_rng_state(rng["torch"].cpu())
    if rng.get("cuda") and _cuda():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    tracker = _megatron_tracker()
    if rng.get("cuda_tracker") and tracker is not None:
        tracker.set_states({k: s.cpu() for k, s in rng["cuda_tracker"].items()})


def read_state(path: Path, role: str, world_size: int, empty: dict[str, Any], *, optimizer: bool) -> dict[str, Any]:
    """The model (and optimizer) state of ``role`` in checkpoint ``path``: a DCP read into ``empty``
    (this process's sharded state, filled in place) across ranks, or the one file of a single process."""
    if world_size > 1:
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        try:
            dcp_load(empty, checkpoint_id=str(path / role))
        except Exception as err:  # DCP wraps every rank's read error in its own exception type
            raise CheckpointUnreadableError(f"{path / role} cannot be read: {first_line(err)}") from None
        return empty
    state = read(path / f"{role}.pt")
    check_state(state, path / f"{role}.pt", optimizer=optimizer)
    return state


def cannot_resume(role: str, path: Path, err: BaseException) -> EngineConfigError:
    """A state that does not fit this model or layout (a shape or key mismatch), with the fix."""
    return EngineConfigError(
        f"cannot resume the {role} from checkpoint {path}: {first_line(err)}; fix: give this run a "
        "new checkpoint.dir if that checkpoint belongs to another model or layout"
    )


def load_sharded(
    path: Path,
    role: str,
    rank: int,
    world_size: int,
    *,
    same_run: Callable[[Mapping[str, Any]], None],
    model: Any,
    optimizer: Any,
    empty: Callable[[], dict[str, Any]],
    optim_options: Any = None,
) -> dict[str, Any]:
    """Load checkpoint ``path`` into a torch.distributed.checkpoint engine (FSDP, Archon): this
    rank's own file first (``same_run`` raises when it belongs to another model or engine), every
    rank told of any rank's problem before the collective read, then the model (and optimizer)
    state (``optim_options``: set_state_dict's options). Returns the rank file's metadata (the caller
    restores its RNG state: :func:`restore_rng`)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    problem: Exception | None = None
    try:
        own = own_file(path, f"{role}-rank{rank}.pt", "a different number of ranks")
        meta = read(own)
        same_run(meta)
        check_meta(meta, own)
    except (EngineConfigError, FileNotFoundError) as err:  # CheckpointUnreadableError included
        problem = err
    agree(problem, world_size)
    try:
        state = read_state(path, role, world_size, empty() if world_size > 1 else {}, optimizer=optimizer is not None)
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=optim_options,
            )
    except (CheckpointUnreadableError, EngineConfigError):
        raise
    except (RuntimeError, KeyError, ValueError) as err:
        raise cannot_resume(role, path, err) from None
    return meta
