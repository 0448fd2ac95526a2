"""LoRA adapters on the rollout servers: versioned names, the load/unload plan, the check.

With ``actor.lora.sync: adapter`` the servers keep the base model and the trainer sends only the
adapter after each step, under the name ``<name>-v<k>`` (:class:`AdapterSlots`). A request sent
at weight version k names that adapter (vLLM: ``model``, SGLang: ``lora_path``); version 0 is the
base model, no adapter. No pause is needed: a request in flight keeps the adapter it named, so
its tokens keep their exact version.

One sync on one server (:func:`sync_adapter`): list what the server holds, unload our versions
outside the window (the newest ``keep``) and the new one if it is there already, then load the
new one, then list again. Unloading first means the server never lists more than ``keep`` of our
adapters, so a server started with ``--max-loras keep`` (vLLM; SGLang ``--max-loaded-loras``) is
never asked for more. The sync counts only when the second listing shows the new version and
nothing of ours outside the window; otherwise it fails with one line naming the server, and the
trainer does not train on as if the server had the new weights.

Both servers list loaded adapters in ``GET /v1/models`` as entries with a ``parent`` (the base).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treetrain.rl.rollout.base import RolloutError

if TYPE_CHECKING:
    from treetrain.rl.rollout.http import HTTPRollout


@dataclass(frozen=True, slots=True)
class AdapterSlots:
    """The adapter's base ``name`` and how many versions a server keeps (``keep``: the newest
    ones; the trainer sets ``maxStaleness + 2``)."""

    name: str
    keep: int

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", self.name):
            raise RolloutError(f"adapter name {self.name!r}: use letters, digits, '_', '.' and single '-'")
        if self.keep < 1:
            raise RolloutError(f"adapter slots: keep must be >= 1, got {self.keep}")

    def name_of(self, version: int) -> str:
        return f"{self.name}-v{version}"

    def version_of(self, name: str) -> int | None:
        """The version of one of our adapter names; None for any other name."""
        m = re.fullmatch(re.escape(self.name) + r"-v(\d+)", name)
        return int(m.group(1)) if m else None

    def window(self, version: int) -> list[int]:
        """The versions a server keeps once it serves ``version`` (version 0, the base, is none)."""
        return list(range(max(1, version - self.keep + 1), version + 1))

    def model_for(self, version: int) -> str | None:
        """The adapter a request at ``version`` names; None at version 0 (the base model)."""
        return self.name_of(version) if version >= 1 else None


def listed_names(models: Any) -> list[str]:
    """The adapters of a ``GET /v1/models`` answer (entries with a parent model)."""
    try:
        return [str(m["id"]) for m in models["data"] if m.get("parent")]
    except (KeyError, TypeError, AttributeError) as err:
        raise RolloutError(f"unexpected /v1/models answer: {err!r} in {str(models)[:300]}") from None


def plan_unloads(listed: list[int], version: int, slots: AdapterSlots) -> list[int]:
    """Our versions to unload before loading ``version``, oldest first: those outside its window,
    and ``version`` itself when it is listed already (a sync retried after a failure: its files
    may have changed)."""
    keep = set(slots.window(version)) - {version}
    return sorted(v for v in set(listed) if v not in keep)


def served_version(listed: list[int]) -> int:
    """The version a server serves, read from its adapters: the newest of ours, 0 (the base
    model) when it lists none (a server that restarted)."""
    return max(listed, default=0)


def sync_adapter(client: HTTPRollout, endpoint: str, path: str, version: int, slots: AdapterSlots) -> None:
    """Make ``endpoint`` serve the adapter saved at ``path`` as ``version`` (the module docstring
    says how); RolloutError with one line when it does not list it afterwards."""
    before = client.adapter_versions(endpoint, slots)
    for old in plan_unloads(before, version, slots):
        client.unload_adapter(endpoint, slots.name_of(old))
    name = slots.name_of(version)
    client.load_adapter(endpoint, name, path)
    after = client.adapter_versions(endpoint, slots)
    if version not in after:
        raise RolloutError(
            f"weight sync: {endpoint} accepted adapter {name} from {path} but does not list it "
            f"(it lists {_names(after, slots)}): not training on as if it served version {version}"
        )
    extra = sorted(set(after) - set(slots.window(version)))
    if extra:
        raise RolloutError(
            f"weight sync: {endpoint} still lists {_names(extra, slots)} after loading {name} "
            f"(at most {slots.keep} versions of {slots.name} may be loaded)"
        )


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def check_adapter_dir(path: str) -> None:
    """A PEFT adapter directory a server can load, or RolloutError naming what is missing (a server
    answers a path it cannot read with an error that names no file)."""
    missing = [f for f in ADAPTER_FILES if not (Path(path) / f).is_file()]
    if missing:
        raise RolloutError(
            f"adapter at {path} is incomplete (missing {', '.join(missing)}): not asking the servers to load it"
        )


def _names(versions: list[int], slots: AdapterSlots) -> str:
    return ", ".join(slots.name_of(v) for v in sorted(versions)) or "no adapter of ours"
