"""What every rollout source shares: sampling parameters, the generation it returns, the client
interface, and the errors."""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treetrain.rl.rollout.gate import WeightGate  # gate.py imports RolloutError from here

KINDS = ("local", "sglang", "vllm")
REMOTE_KINDS = ("sglang", "vllm")  # the server kinds :func:`remote_client` builds clients for

_NO_ENDPOINTS = "no rollout servers: set rollout.servers or TREETRAIN_ROLLOUT_ENDPOINTS"


class RolloutError(RuntimeError):
    """A rollout server that cannot be reached or answered wrongly."""


class Unknown(enum.Enum):
    """A server that cannot report which weights it holds."""

    UNKNOWN = "unknown"


UNKNOWN = Unknown.UNKNOWN


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Generation:
    """One reply: its tokens, the sampler's log-prob of each, and ``versions[i]``, the weight
    version token i was sampled with (one entry per token from every client)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str = "length"
    versions: list[int] = field(default_factory=list)


class RolloutClient(ABC):
    """A rollout source. ``gate`` says which weights it serves and holds requests back while a
    weight update runs (treetrain.rl.rollout.gate)."""

    kind: str
    gate: WeightGate
    # Asked while a generate call waits on servers: True abandons the call (RolloutStopped).
    # The synchronous trainer sets it (SIGTERM); None: the call runs to its end.
    stop: Callable[[], bool] | None = None
    # The trained model's vocabulary: a token id a server returns at or past it is refused (an
    # embedding lookup past the table is a device-side assert on a GPU).
    vocab_size: int | None = None

    @abstractmethod
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *, seed: int) -> list[Generation]:
        """One generation per prompt, in order."""

    def update_weights(self, path: str, version: int) -> None:  # noqa: B027 - a no-op unless remote
        """Load the weights saved at ``path`` (remote servers); local rollout shares the model."""

    def update_adapter(self, path: str, version: int) -> None:
        """Load the LoRA adapter saved at ``path`` as ``version`` and check every server lists it
        (remote servers with adapter slots: treetrain.rl.rollout.adapters)."""
        raise RolloutError(f"{self.kind} rollout takes no adapter sync")

    def wait_ready(self, timeout_s: float) -> None:  # noqa: B027
        """Block until every server answers its health check."""

    def close(self) -> None:  # noqa: B027
        """Release connections (nothing to release for plain HTTP requests)."""

    def forget(self) -> None:  # noqa: B027
        """Drop what was kept between the calls of one batch (local rollout: the KV cache)."""

    def stale_servers(self, version: int) -> list[str]:
        """Servers that report weights other than ``version`` (restarted since the last sync)."""
        return []


# A log-prob above this is not one (rounding lets a certain token's be a hair above 0).
LOGPROB_CEILING = 1e-3


def checked(gen: Generation, source: str, vocab_size: int | None) -> Generation:
    """``gen`` if its answer can be trained on: as many log-probs as tokens, every log-prob a
    finite number <= 0, every token id in ``[0, vocab_size)``; else RolloutError naming the first
    problem (a server answering this way is broken or serves another model: it is handled as a
    malformed answer)."""
    if len(gen.logprobs) != len(gen.tokens):
        raise RolloutError(f"bad answer from {source}: {len(gen.tokens)} tokens but {len(gen.logprobs)} log-probs")
    for i, (t, lp) in enumerate(zip(gen.tokens, gen.logprobs, strict=True)):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise RolloutError(
                f"bad answer from {source}: token {i} has id {t}, outside the model's vocabulary of {vocab_size}; "
                "fix: serve the model in model.path"
            )
        if not math.isfinite(lp) or lp > LOGPROB_CEILING:
            raise RolloutError(f"bad answer from {source}: token {i} has log-prob {lp}, not a finite number <= 0")
    return gen
