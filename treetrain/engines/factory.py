"""One factory for every training engine: a model and a backend string in, an :class:`Engine` out.

Called in every process of a torchrun gang (or in one plain process for a world size of 1).
The trainer builds its actor, critic and reference engines with it over the same processes:
the process group is joined once and reused, engines with the same backend string share one
mesh, and a critic or reference with another string of the same world size (actor
``fsdp:d2``, critic ``fsdp:t2``) gets its own mesh over the same ranks. Every rank must build
the same engines in the same order.
"""

from __future__ import annotations

import importlib
from typing import get_args

from treetrain.alloc import Allocation
from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings, check_training_backend
from treetrain.config.backends import check_engine_support
from treetrain.config.errors import EngineConfigError
from treetrain.config.lora import LoraSettings
from treetrain.config.schema import DType
from treetrain.engines import builtin, weights
from treetrain.engines.base import Engine
from treetrain.engines.contract import check_role


def build_engine(
    model: str | ModelSettings,
    backend: str | Allocation,
    *,
    role: str = "actor",
    tree: TreeTrainingSettings | None = None,
    optimizer: OptimizerSettings | None = None,
    dtype: str = "auto",
    lora: LoraSettings | None = None,
) -> Engine:
    """The engine that runs ``backend`` (``fsdp:d4t2``, or the :class:`Allocation` config
    validation parsed it into: the trainer passes that, so a pod parses each string once)
    for ``model``.

    ``model``: a Hugging Face model directory, ``builtin:NAME``, or full :class:`ModelSettings`
    (a string becomes ``ModelSettings(path=model, dtype=dtype)``; settings carry their own
    dtype, and a different ``dtype`` argument is refused). ``dtype`` ``auto`` is bfloat16 on
    CUDA and float32 on the CPU (:func:`treetrain.alloc.precision.resolve_dtype`). ``role``: ``actor`` and ``ref``
    give log-probs, ``critic`` a value model. ``tree``: packing, block size and attention
    (None: the defaults). ``optimizer``: None builds a forward-only engine (a reference
    model, or scoring). ``lora``: train a LoRA adapter over the frozen base (an actor's;
    ``actor.lora``). ``engine.forward(sequences)`` returns per-sequence log-probs (actor,
    ref) or values (critic) in input order.

    Everything that can be checked before joining the process group is (role, dtype, model
    name, backend string): a bad value raises a one-line ``ValueError``
    (:class:`EngineConfigError` or the parser's ``AllocationError``) naming the fix, e.g. for a
    parallel letter the engine refuses (its description in :mod:`treetrain.alloc.registry` says).

    Which class runs the string is its description's ``engine`` (``module:Class``), imported
    here on first use: the registry is the one list of engines, and no engine's torch code (nor
    megatron-core) loads unless a string names that engine.
    """
    check_role(role)
    if isinstance(model, str):
        if dtype not in get_args(DType):
            raise EngineConfigError(f"dtype must be one of {', '.join(get_args(DType))}, got {dtype!r}")
        if not model:
            raise EngineConfigError("model must be a Hugging Face model directory or builtin:NAME, got ''")
        settings = ModelSettings(path=model, dtype=dtype)  # type: ignore[arg-type]  # checked above
    else:
        if dtype not in ("auto", model.dtype):
            raise EngineConfigError(
                f"dtype={dtype!r} conflicts with the settings' {model.dtype}; fix: set ModelSettings(dtype=...) only"
            )
        settings = model
    builtin.check_path(settings.path)
    # A damaged weight file is one line now, not a loader's traceback inside the engine.
    weights.check_model_dir(builtin.local_dir(settings.path), settings.path)
    allocation = check_engine_support(backend) if isinstance(backend, Allocation) else check_training_backend(backend)
    engine_class = engine_class_of(allocation)
    layout = engine_class.init_layout(allocation)
    tree = tree if tree is not None else TreeTrainingSettings()
    return engine_class(settings, layout, tree, optimizer, role=role, lora=lora)


def engine_class_of(allocation: Allocation) -> type[Engine]:
    """The :class:`Engine` subclass that runs ``allocation`` (its description's ``engine``)."""
    where = allocation.spec.engine
    module, _, name = where.partition(":")
    if not module or not name:
        raise EngineConfigError(f"no {allocation.backend} engine in this build; use another backend")
    found = getattr(importlib.import_module(module), name)
    if not (isinstance(found, type) and issubclass(found, Engine)):
        raise EngineConfigError(f"{where}, the {allocation.backend} engine's class, is not an Engine")
    return found
