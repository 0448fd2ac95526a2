"""The weight gate: which weights the rollout servers serve, and a barrier that holds generation
requests back while those weights are being replaced.

A weight update closes the gate around the whole of it (pause the servers, push the weights,
resume them) and, only when every server took the new weights, sets the new version and opens
the gate again. A request sent while the gate is open is labelled with the version read at that
moment; since the gate was open, every server held that version. A failed update leaves the gate
closed and failed: the servers may hold the old weights, the new ones or a mix, so no request
may be labelled with either until a later update succeeds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from treetrain.rl.rollout.base import RolloutError


class WeightGate:
    """``version``: the weights the servers serve (0: the initial ones; after training step k,
    0-based, the trainer syncs version k + 1). Safe to use from any thread."""

    def __init__(self, version: int = 0) -> None:
        self._cond = threading.Condition()
        self._version = version
        self._open = True
        self._failure = ""  # why the last update failed; empty when it did not

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    @property
    def is_open(self) -> bool:
        with self._cond:
            return self._open

    def changed_since(self, version: int) -> bool:
        """Whether an update began after a request was sent with ``version`` (the gate closed, or
        opened again on a newer version): then an aborted or broken reply was the update's doing."""
        with self._cond:
            return not self._open or self._version != version

    def wait_open(self, timeout: float) -> int:
        """Block until the gate is open and return the version it serves. Raises RolloutError when
        the last update failed (the servers' weights are unknown) or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._open:
                if self._failure:
                    raise RolloutError(self._failure)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutError(
                        f"rollout: the weight update to version {self._version + 1} did not finish within "
                        f"{timeout:.0f}s (raise trainer.rollout.timeoutSeconds if weight updates take longer)"
                    )
                self._cond.wait(left)
            return self._version

    @contextlib.contextmanager
    def update(self, version: int) -> Iterator[None]:
        """Closed for the body (the pause, push and resume of one update); on success the gate
        serves ``version`` and opens. An exception leaves it closed and failed, and is re-raised."""
        with self._cond:
            self._open, self._failure = False, ""
        try:
            yield
        except BaseException as err:
            self.fail(
                f"rollout: the weight update to version {version} failed, so the servers' weights are unknown: {err}"
            )
            raise
        with self._cond:
            self._version, self._open = version, True
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """Close the gate for good (until the next successful update): every waiting and every
        later request raises RolloutError(reason)."""
        with self._cond:
            self._open, self._failure = False, reason
            self._cond.notify_all()

    def set_version(self, version: int) -> None:
        """Record the weights the servers serve without an update (local rollout: the sampler is the
        trained model itself)."""
        with self._cond:
            self._version = version
